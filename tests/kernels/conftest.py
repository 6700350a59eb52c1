"""Kernel tests: without CUDA the Triton launchers run under the interpreter on
CPU tensors; with CUDA the same tests run the compiled kernels on the GPU."""
import os

import torch  # does not import triton

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before triton is imported anywhere (@triton.jit reads it).
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def _fix_interpreter_scalar_index():
    """Triton 3.6's interpreter turns a loaded scalar (a 1-element array) into a
    Python int with int(array), which NumPy >= 2.4 refuses for arrays of ndim > 0.
    Kernels hit it in ``range(start, end)`` with runtime bounds. Use .item()."""
    try:
        from triton.runtime import interpreter
    except Exception:
        return
    orig = getattr(interpreter, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_blitz_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._blitz_fixed = True
    interpreter._patch_lang_tensor = patched


def _fix_interpreter_bf16_dot():
    """The interpreter stores bf16 as uint16 and its tl.dot multiplies those raw
    bits. Widen bf16 operands to fp32 first (exact; accumulation is fp32 anyway)."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except Exception:
        return
    builder = interpreter.InterpreterBuilder
    orig = builder.create_dot
    if getattr(orig, "_blitz_fixed", False):
        return

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            bits = h.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._blitz_fixed = True
    builder.create_dot = create_dot


def _fix_interpreter_bf16_rounding():
    """The interpreter casts fp32 -> bf16 by dropping the low 16 bits (toward zero); the
    GPU's cvt.rn.bf16.f32 rounds to nearest even. Round to nearest even here too, so that
    a bf16 kernel under the interpreter rounds as on the GPU and can be held to the
    reference within an ulp (a truncating cast is 0.5 ulp low on average, as large as the
    systematic errors the bf16 tests must catch). Casts to fp8 (e4m3) round to nearest even too."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except Exception:
        return
    builder = interpreter.InterpreterBuilder
    orig_cast, orig_fp_to_fp = builder.cast_impl, builder.create_fp_to_fp
    if getattr(orig_cast, "_blitz_fixed", False):
        return

    def rne(h):
        bits = np.asarray(h.data, dtype=np.float32).view(np.uint32)
        out = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
        nan = (bits >> 16).astype(np.uint16) | np.uint16(0x40)  # a NaN stays a (quiet) NaN
        return interpreter.TensorHandle(np.where(np.isnan(h.data), nan, out), tl.bfloat16)

    try:
        from triton._C.libtriton import ir
        rtne = ir.ROUNDING_MODE.RTNE
    except Exception:
        rtne = None

    def is_f32_to_bf16(src, dst_type):
        return src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16

    def fp8(src):
        """A 16/32-bit float -> e4m3 (the fp8 KV cache's stores): the interpreter's own cast rounds
        toward zero; torch's rounds to nearest even, as the GPU's cvt.rn.satfinite does."""
        import torch
        data = np.asarray(src.data)
        if src.dtype.scalar == tl.bfloat16:
            data = (data.astype(np.uint32) << 16).view(np.float32)
        wide = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
        return interpreter.TensorHandle(wide.to(torch.float8_e4m3fn).view(torch.uint8).numpy(), tl.float8e4nv)

    def to_fp8(src, dst_type):
        return dst_type.scalar == tl.float8e4nv and src.dtype.scalar in (tl.float32, tl.bfloat16, tl.float16)

    def cast_impl(self, src, dst_type):
        if to_fp8(src, dst_type):
            return fp8(src)
        return rne(src) if is_f32_to_bf16(src, dst_type) else orig_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if is_f32_to_bf16(src, dst_type) and rounding_mode in (None, rtne):
            return rne(src)
        if to_fp8(src, dst_type) and rounding_mode in (None, rtne):
            return fp8(src)
        return orig_fp_to_fp(self, src, dst_type, rounding_mode)

    cast_impl._blitz_fixed = True
    builder.cast_impl = cast_impl  # (create_fp_trunc & co. call self.cast_impl)
    builder.create_fp_to_fp = create_fp_to_fp


def _reimport_triton_if_compiled_early():
    """@triton.jit (triton's own tl.sum & co. included) picks interpreter or
    compiler when the module is imported. If something imported triton before
    this file set TRITON_INTERPRET, re-import triton's Python modules (its C
    extension is kept) and blitzllm.kernels so the tests here are interpreted.
    Modules that already hold the old objects keep them (CUDA-only paths)."""
    import sys

    if HAS_CUDA or "triton" not in sys.modules:
        return
    if type(getattr(sys.modules.get("triton.language"), "sum", None)).__name__ \
            == "InterpretedFunction":
        return
    for name in list(sys.modules):
        if (name == "triton" or name.startswith("triton.")) and not name.startswith("triton._C"):
            del sys.modules[name]
        elif name == "blitzllm.kernels" or name.startswith("blitzllm.kernels."):
            del sys.modules[name]
    import triton.language  # noqa: F401


_reimport_triton_if_compiled_early()
_fix_interpreter_scalar_index()
_fix_interpreter_bf16_dot()
_fix_interpreter_bf16_rounding()


def pytest_configure(config):
    registered = config.getini("markers")
    if not any(str(m).split(":")[0].strip() == "gpu" for m in registered):
        config.addinivalue_line("markers", "gpu: needs CUDA")


def _interpreter_usable():
    try:
        import triton.language as tl
    except Exception:
        return False
    # triton's own helpers (tl.sum, ...) are jit functions too: if triton was
    # imported before TRITON_INTERPRET was set, they are compiled and unusable here.
    return type(tl.sum).__name__ == "InterpretedFunction"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def device():
    """Where the *_triton launchers run: the GPU if there is one, else the
    interpreter on CPU tensors."""
    if HAS_CUDA and not INTERPRET:
        return "cuda"
    if not _interpreter_usable():
        # A failure, not a skip: most kernel tests take this fixture, and a broken interpreter
        # (a triton upgrade, an early import) must turn CI red rather than skip them in silence.
        pytest.fail("no CUDA and no usable Triton interpreter: triton failed to import, or was "
                    "imported before TRITON_INTERPRET=1 was set (set it in the environment or in "
                    "the root tests/conftest.py)", pytrace=False)
    return "cpu"


def ulp(dtype: torch.dtype, x) -> torch.Tensor:
    """The spacing of ``dtype`` at magnitude ``x`` (> 0): eps(dtype) * 2**floor(log2 x),
    i.e. 1 ulp of bf16 at 3.0 is 2**-7 * 2 = 1/64."""
    x = torch.as_tensor(x, dtype=torch.float64)
    return torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(x)))


def assert_close_ulps(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype = None,
                      ulps: float = 1.0, mean_ulps: float = 0.25, what: str = ""):
    """``out`` against ``ref`` at ``dtype``'s precision (default ``ref``'s dtype), scaled
    to the reference rather than a flat tolerance:

    * each element within ``ulps`` ulps of max|ref| (so small entries are judged at the
      tensor's precision, not at their own);
    * and on average within ``mean_ulps`` of the dtype's relative spacing:
      mean|out - ref| <= mean_ulps * eps(dtype) * mean|ref|. A kernel that accumulates in
      fp32 and rounds like the reference is off by 0 or 1 ulp in a few elements; a
      systematic error below one ulp (an RMSNorm 0.4% off is half the bf16 spacing,
      invisible element by element) is off in most of them."""
    dtype = dtype or ref.dtype
    o, r = out.detach().cpu().double(), ref.detach().cpu().double()
    assert o.shape == r.shape, f"{what} shape {tuple(o.shape)} != {tuple(r.shape)}"
    assert torch.isfinite(o).all() and torch.isfinite(r).all(), f"{what} non-finite values"
    amax = r.abs().max()
    if amax == 0:
        assert torch.equal(o, r), f"{what} reference is all zeros, output is not"
        return
    unit = ulp(dtype, amax)
    err = (o - r).abs()
    worst = int(err.argmax())
    assert err.max() <= ulps * unit, (
        f"{what} max |out - ref| = {float(err.max()):.4g} = {float(err.max() / unit):.2f} ulp of "
        f"max|ref| {float(amax):.4g} ({dtype}), allowed {ulps}; at flat index {worst}: "
        f"out {float(o.flatten()[worst]):.6g} ref {float(r.flatten()[worst]):.6g}")
    rel = err.mean() / r.abs().mean()
    eps = torch.finfo(dtype).eps
    assert rel <= mean_ulps * eps, (
        f"{what} mean |out - ref| / mean |ref| = {float(rel):.3g} = {float(rel / eps):.3f} eps "
        f"({dtype}), allowed {mean_ulps}: a systematic error")


def sm90_compile(call: str) -> str:
    """stdout of ``tools/ptxas_check.py``'s ``call`` (e.g. ``"fp8_weights()"``) run in a fresh
    process with the stand-in sm_90 driver (a compile for Hopper on any machine); fails the
    test where it fails."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys; sys.path.insert(0, 'tools'); sys.path.insert(0, '.')\n"
            "import ptxas_check as pc, triton.runtime.driver as drv\n"
            f"drv.set_active(pc._Sm90()); pc.{call}\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=dict(os.environ, TRITON_INTERPRET="0"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def assert_gdn_sm90_no_spills(printer: str, names: set) -> None:
    """``tests/kernels/gdn_sm90.py``'s ``printer`` run through ``sm90_compile`` (from a module
    that does not import this conftest, which would turn the interpreter on): one ptxas report
    per name in ``names``, each without spills."""
    out = sm90_compile(f"ptxas_report\nfrom tests.kernels.gdn_sm90 import {printer}\n{printer}(pc)")
    rows = dict(ln.split(" ", 1) for ln in out.strip().splitlines())
    assert set(rows) == set(names), out
    for name, report in rows.items():
        assert "registers" in report and "0 bytes spill stores" in report, (name, report)
