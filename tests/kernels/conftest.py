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
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set "
                    "(set it in the environment or in the root tests/conftest.py)")
    return "cpu"


def sm90_compile(call: str) -> str:
    """stdout of ``scripts/ptxas_check.py``'s ``call`` (e.g. ``"fp8_weights()"``) run in a fresh
    process with the stand-in sm_90 driver (a compile for Hopper on any machine); fails the
    test where it fails."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys; sys.path.insert(0, 'scripts'); sys.path.insert(0, '.')\n"
            "import ptxas_check as pc, triton.runtime.driver as drv\n"
            f"drv.set_active(pc._Sm90()); pc.{call}\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=dict(os.environ, TRITON_INTERPRET="0"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout
