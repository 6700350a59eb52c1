"""The LoRA kernels (kernels/lora): the shrink + expand launches against the definition, row by
row ``y + (x @ A[s]^T) @ B[s]`` in float64 (interpreter on the CPU, compiled on a GPU), at ranks
and widths off the blocks, with base-model rows (-1) left bit-equal, repeated slots, the
SiLU-and-mul input, every K split count; the torch form (one GEMM and a one-hot mask) against
the same definition; the tolerance against plausible bugs; sm_90 compile."""
import pytest
import torch

pytest.importorskip("triton")

from blitzllm.kernels.activation import reference_silu_and_mul  # noqa: E402
from blitzllm.kernels.lora import lora as lk  # noqa: E402
from tests.kernels.conftest import HAS_CUDA, assert_close_ulps, sm90_compile  # noqa: E402

# Scaled to max|ref| (tests/kernels/conftest.py). The kernels sum in fp32 and round once, into
# y's dtype, as the definition does: a half-precision output is the definition's but for ties.
ULPS = {torch.float32: 8, torch.bfloat16: 1}
MEAN_EPS = {torch.float32: 2.0, torch.bfloat16: 0.25}


def _case(rows, slots, sr, k, n, dtype, device, silu=False, seed=0):
    """y, x, A [slots, sr, k], B^T [slots, sr, n] and the rows' slots; each slot's weights differ,
    and a LoRA row's delta is about the size of y, so a wrong slot or a lost term shows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * k if silu else k, generator=g)
    a = torch.randn(slots, sr, k, generator=g) / k ** 0.5
    b = torch.randn(slots, sr, n, generator=g) / sr ** 0.5
    y = torch.randn(rows, n, generator=g)
    return [t.to(device, dtype) for t in (y, x, a, b)]


def definition(y, x, a, b, slots, silu=False):
    """Row by row in float64 from the operands as given (x through silu_and_mul first), rounded
    once to y's dtype; -1 rows are y."""
    if silu:
        x = reference_silu_and_mul(x)
    out = y.double().clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            out[i] += (x[i].double() @ a[s].double().t()) @ b[s].double()
    return out.to(y.dtype)


def close(out, ref, dtype, what=""):
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape, what
    assert_close_ulps(out, ref, dtype, ulps=ULPS[dtype], mean_ulps=MEAN_EPS[dtype], what=what)


CASES = [  # rows, slot per row, slots, SR (slices * rank), K, N
    ([0], 1, 16, 64, 32),
    ([2, -1, 0, 2], 3, 48, 300, 200),          # SR not a power of 2; K, N off the blocks; a base row
    ([1, 1, 1], 2, 3 * 8, 129, 129),           # one slot for every row; K one past a block
    ([-1, -1], 2, 16, 64, 64),                 # no LoRA row: y untouched
    ([3, 0, -1, 1, 2, 3, 0], 4, 2 * 64, 520, 96),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n_slots,sr,k,n", CASES)
@pytest.mark.parametrize("splits", [0, 1, 3])
@pytest.mark.parametrize("silu", [False, True])
def test_kernels_match_definition(dtype, rows, n_slots, sr, k, n, splits, silu, device):
    y, x, a, b = _case(len(rows), n_slots, sr, k, n, dtype, device, silu)
    slots = torch.tensor(rows, device=device)
    ref = definition(y, x, a, b, slots, silu)
    got = y.clone()
    assert lk.lora_add_triton(got, x, a, b, slots, silu_mul_input=silu, splits=splits) is got
    close(got, ref, dtype, f"splits={splits}")
    base = slots < 0
    assert torch.equal(got[base], y[base])     # base-model rows are not written


def test_strided_rows_and_no_rows(device):
    """x and y as row views of wider buffers (the launcher takes row strides); zero rows."""
    y, x, a, b = _case(3, 2, 16, 96, 80, torch.float32, device)
    xw = torch.zeros(3, 130, device=device)
    xw[:, 7:103] = x
    yw = torch.zeros(3, 90, device=device)
    yw[:, 3:83] = y
    slots = torch.tensor([1, -1, 0], device=device)
    lk.lora_add_triton(yw[:, 3:83], xw[:, 7:103], a, b, slots)
    close(yw[:, 3:83], definition(y, x, a, b, slots), torch.float32)
    assert torch.equal(yw[:, :3], torch.zeros(3, 3, device=device)) and torch.equal(yw[:, 83:], torch.zeros(3, 7, device=device))
    empty = torch.empty(0, 80, device=device)
    assert lk.lora_add_triton(empty, x[:0], a, b, slots[:0]).shape == (0, 80)


@pytest.mark.parametrize("silu", [False, True])
def test_torch_form_matches_definition(silu):
    """reference_lora_add (one GEMM over every slot, the one-hot mask, one addmm), fp32 on the
    CPU, against the definition; slot_mask's rows."""
    y, x, a, b = _case(5, 3, 48, 300, 200, torch.float32, "cpu", silu)
    slots = torch.tensor([2, -1, 0, 2, 1])
    mask = lk.slot_mask(slots, 3, torch.float32)
    assert mask.shape == (5, 3, 1) and mask[1].sum() == 0 and mask[0, 2, 0] == 1 and mask[:, :, 0].sum() == 4
    got = lk.reference_lora_add(y.clone(), x, a, b, mask, silu_mul_input=silu)
    close(got, definition(y, x, a, b, slots, silu), torch.float32)


def _mutants():
    """Plausible kernel bugs, as torch functions of the definition's arguments."""
    def wrong_slot(y, x, a, b, slots, silu):
        return definition(y, x, a, b, torch.where(slots >= 0, (slots + 1) % a.shape[0], slots), silu)

    def one_split(y, x, a, b, slots, silu):          # the expand reads the first K split only
        xs = (reference_silu_and_mul(x) if silu else x).clone()
        xs[:, a.shape[-1] // 2:] = 0
        return definition(y, xs, a, b, slots)

    def silu_dropped(y, x, a, b, slots, silu):
        return definition(y, x[:, :a.shape[-1]] if silu else x, a, b, slots, False)

    def shrink_rounded(y, x, a, b, slots, silu):     # the rank vector rounded to bf16 before B
        out = y.double().clone()
        xs = reference_silu_and_mul(x) if silu else x
        for i, s in enumerate(slots.tolist()):
            if s >= 0:
                t = (xs[i].double() @ a[s].double().t()).to(torch.bfloat16).double()
                out[i] += t @ b[s].double()
        return out.to(y.dtype)

    return {"wrong slot": wrong_slot, "one K split": one_split, "silu dropped": silu_dropped,
            "rank vector in bf16": shrink_rounded}


@pytest.mark.parametrize("silu", [False, True])
def test_tolerance_rejects_plausible_bugs(silu):
    """The check above rejects each mutant on the tests' own inputs (bf16, 7 rows; fp32 for the
    rounding mutant, which bf16's own rounding of y hides)."""
    for name, f in _mutants().items():
        if silu is False and name == "silu dropped":
            continue
        dtype = torch.float32 if name == "rank vector in bf16" else torch.bfloat16
        y, x, a, b = _case(7, 4, 2 * 64, 520, 96, dtype, "cpu", silu)
        slots = torch.tensor([3, 0, -1, 1, 2, 3, 0])
        ref = definition(y, x, a, b, slots, silu)
        with pytest.raises(AssertionError):
            close(f(y, x, a, b, slots, silu), ref, dtype, name)


def test_dispatch_rule(device, monkeypatch):
    """Kernels for the rows' slots (one per row) on CUDA only, up to KERNEL_MAX_ROWS rows; the
    one-GEMM form off CUDA (here the CUDA check forced, to see the row count decide)."""
    assert not lk.use_lora_kernels(torch.zeros(1, dtype=torch.int64))
    monkeypatch.setattr(lk, "use_triton", lambda t: True)
    for rows in (1, lk.KERNEL_MAX_ROWS):
        assert lk.use_lora_kernels(torch.zeros(rows, dtype=torch.int64, device=device))
    for rows in (lk.KERNEL_MAX_ROWS + 1, 20, 4096):
        assert not lk.use_lora_kernels(torch.zeros(rows, dtype=torch.int64, device=device))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_llama_8b_sizes_on_gpu(rows):
    """CUDA at Llama-3.1-8B's widest LoRA linears, rank 16, 4 slots: qkv (K 4096, N 6144, 3
    slices) and down with its SiLU-and-mul input (K 14336)."""
    for sr, k, n, silu in [(48, 4096, 6144, False), (16, 14336, 4096, True)]:
        y, x, a, b = _case(rows, 4, sr, k, n, torch.bfloat16, "cuda", silu)
        slots = torch.arange(rows, device="cuda") % 5 - 1
        got = lk.lora_add_triton(y.clone(), x, a, b, slots, silu_mul_input=silu)
        close(got, definition(y, x, a, b, slots, silu), torch.bfloat16)


def test_lora_kernels_compile_for_sm90():
    """Both kernels compile for sm_90 (the stand-in driver of tools/ptxas_check.py) at Llama-3.1-8B's
    qkv and down (SiLU-and-mul input) sizes, bf16, rank 16, with the PDL wait, without spills."""
    out = sm90_compile("lora()")
    rows = dict(ln.split(": ", 1) for ln in out.strip().splitlines())
    assert set(rows) == {"lora shrink qkv", "lora shrink down+silu", "lora expand qkv"}, out
    for name, report in rows.items():
        assert report.startswith("pdl=True ") and "registers" in report and "0 bytes spill stores" in report, (
            name, report)
