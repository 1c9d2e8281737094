import logging
import threading
import weakref
from unittest import mock

import numpy as np
import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from qvl import settings
from qvl.conversation import Turn
from qvl.engine import checkpoint, cpu, generate, jit, lean, modelcache, modes, quant, vnni
from qvl.engine.local import Engine
from qvl.settings import GenParams
from qvl.tools import bench


@pytest.mark.parametrize("flags, halves, mode", [
    (frozenset({"AVX2"}), False, "w8a14"),  # Zen 3: fbgemm reads a second decode row at no cost
    (frozenset({"AVX2"}), True, "int8"),  # Zen 1: each 256-bit op in two halves, fbgemm bound by computing
    (frozenset({"AVX2", "AVX-512"}), False, "w8a14"),
    (frozenset({"AVX2", "AVX-512", "VNNI"}), False, "w8a14"),
    (frozenset({"AVX2", "AVX-512", "VNNI", "BF16"}), False, "w8a14"),
    (frozenset({"AVX2", "AVX-512", "VNNI", "BF16", "AMX"}), False, "w8a14"),
    (frozenset(), False, "fp32"),
    (frozenset(), True, "fp32"),
])
def test_auto_resolves_to_a_concrete_mode_for_the_cpu(flags, halves, mode):
    assert modes.resolve("auto", flags, halves, arm=False) == mode
    assert modes.resolve("int8", flags, halves, arm=False) == "int8"  # an explicit mode is never overridden


GRAVITON3 = """processor	: 0
BogoMIPS	: 2100.00
Features	: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop \
sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng
CPU implementer	: 0x41
CPU architecture: 8
CPU variant	: 0x1
CPU part	: 0xd40
CPU revision	: 1
""".replace("\\\n", "")


@pytest.mark.parametrize("text", [GRAVITON3, "processor\t: 0\nFeatures\t: fp asimd\n"])
def test_an_arm_cpu_gets_torchs_int8_weight_only_kernel_never_fbgemms(text):
    flags = modes.cpu.flags(text)
    assert flags == ({"DOTPROD", "SVE", "I8MM", "BF16"} if text is GRAVITON3 else set())
    assert modes.resolve("auto", flags, halves=False, arm=True) == "w8a16"
    assert modes.native_bf16(flags) == (text is GRAVITON3)  # bf16 dot products: w8a16's activations are native
    assert modes.cpu.arm("aarch64") and modes.cpu.arm("arm64") and not modes.cpu.arm("x86_64")


def test_an_arm_cpu_is_named_by_its_core_where_cpuinfo_names_no_model():
    assert modes.cpu.model_name(GRAVITON3) == "Neoverse V1"


def test_on_arm_the_fbgemm_modes_are_refused_with_what_runs_there(monkeypatch, capsys):
    monkeypatch.setattr(modes.cpu, "arm", lambda machine=None: True)
    for mode in modes.FBGEMM:
        with pytest.raises(SystemExit):
            settings.parse(["--quant", mode], env={})
        assert "fbgemm, which PyTorch builds for x86 CPUs only" in capsys.readouterr().err
    assert settings.parse([], env={}).mode == "w8a16"
    assert settings.parse(["--quant", "bf16"], env={}).mode == "bf16"


def test_w8a16_loads_and_answers_where_torch_has_no_fbgemm(tiny_dir, monkeypatch):
    """As on Arm, where fbgemm's packing raises this. int8 fails there, w8a16 answers."""
    def no_fbgemm(*args):
        raise RuntimeError("unknown architecure")

    for op in ("linear_prepack", "linear_dynamic"):
        monkeypatch.setattr(torch.ops.quantized, op, no_fbgemm)
    flags = ["--model", str(tiny_dir), "--no-cache", "--no-model-cache", "--require-model", "--quant"]
    with pytest.raises(RuntimeError, match="unknown architecure"):
        Engine(settings.parse([*flags, "int8", "--int8-kernel", "fbgemm"], env={}))
    engine = Engine(settings.parse([*flags, "w8a16"], env={}))
    *pieces, stats = engine.chat([Turn("user", "hi")], GenParams(greedy=True, max_new_tokens=5, min_new_tokens=5))
    assert engine.fallback is None and stats.new_tokens == 5


def test_auto_is_resolved_once_per_start_and_the_layers_below_take_only_concrete_modes(tiny_dir, tmp_path,
                                                                                     monkeypatch):
    resolved, resolve = [], modes.resolve
    monkeypatch.setattr(modes, "resolve", lambda mode, *args: resolved.append(mode) or resolve(mode, *args))
    empty = tmp_path / "no-checkpoint"
    empty.mkdir()
    # A first start (converting), a second (reading what the first kept), and one that falls back to the tiny model.
    for model in (tiny_dir, tiny_dir, empty):
        resolved.clear()
        config = settings.parse(["--model", str(model), "--quant", "auto", "--no-cache", "--model-cache-dir",
                                 str(tmp_path / "models")], env={})
        engine = Engine(config, modelcache.read_ahead(config))  # as app.py starts
        assert resolved == ["auto"] and engine.mode == config.mode in modes.MODES
        assert engine.settled.wait(60)  # the first start keeps its model for the second to read
    assert engine.fallback
    for load in (lambda: checkpoint.load_model(str(tiny_dir), "auto"),
                 lambda: modelcache.load(str(tiny_dir), "auto", "v", str(tmp_path / "models"))):
        with pytest.raises(AssertionError, match="auto"):
            load()


@pytest.mark.parametrize("mode", ["bf16", "int8", "int4", "w8a16", "w8a14", "auto"])
def test_every_mode_loads_and_answers_through_the_engine(tiny_dir, mode):
    flags = ["--model", str(tiny_dir), "--quant", mode, "--no-cache", "--no-model-cache"]
    engine = Engine(settings.parse(flags, env={}))
    assert engine.fallback is None and engine.precision.startswith(modes.resolve(mode))
    *pieces, stats = engine.chat([Turn("user", "hi")], GenParams(greedy=True, max_new_tokens=5, min_new_tokens=5))
    assert stats.new_tokens == 5


@pytest.mark.parametrize("flags, warned", [(frozenset({"AVX2"}), True), (frozenset({"AVX2", "BF16"}), False)])
def test_bf16_matmuls_without_bf16_instructions_are_warned_of(tiny_dir, tmp_path, monkeypatch, caplog, flags, warned):
    caplog.set_level(logging.INFO, "qvl")
    monkeypatch.setattr(modes.cpu, "flags", lambda: flags)
    store = ["--model-cache-dir", str(tmp_path)]
    for start in ("converting", "reading the model cache"):
        caplog.clear()
        engine = Engine(settings.parse(["--model", str(tiny_dir), "--quant", "w8a16", "--no-cache", *store], env={}))
        assert ("emulated" in caplog.text) == warned, start
        assert ("from the model cache" in caplog.text) == (start != "converting")
        engine.settled.wait(60)  # the first start keeps its model for the second to read
    caplog.clear()
    Engine(settings.parse(["--model", str(tiny_dir), "--quant", "int8", "--no-cache", *store], env={}))
    assert "emulated" not in caplog.text


def test_int4_linear_stays_close_to_the_float_layer():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 48, bias=True)
    x = torch.randn(3, 256)
    want = linear(x)
    for rows in (x[:1], x):  # one row takes the int4 kernel, more than DECODE_ROWS would take the int8 twin
        got = quant.Int4Linear.quantize(linear, prefill=True)(rows)
        assert got.shape == linear(rows).shape
        assert (got - linear(rows)).norm() / linear(rows).norm() < 0.1
    assert not torch.allclose(quant.Int4Linear.quantize(linear, prefill=False)(x), want, atol=1e-6)  # it is quantized


def test_w8a16_decode_kernel_and_prefill_gemm_compute_the_int8_weights_exactly_read(monkeypatch):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 48, bias=True)
    w8a16 = quant.Int8WeightOnly.quantize(linear)
    assert w8a16.int8_weight.dtype == torch.int8 and w8a16.scale.dtype == torch.bfloat16
    exact = w8a16.int8_weight.float() * w8a16.scale.float()[:, None]  # the weights as stored, read exactly
    assert (exact - linear.weight).abs().max() <= w8a16.scale.float().max() / 2 * 1.01  # rounded, never clamped
    kernel = []
    real = torch._weight_int8pack_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda *a: kernel.append(a[0].shape[0]) or real(*a))
    x = torch.randn(1, 40, 256)  # more rows than W8A16_ROWS: the bf16 GEMM
    together = w8a16(x)
    assert kernel == []
    one_by_one = torch.cat([w8a16(x[:, i:i + 1]) for i in range(x.shape[1])], 1)  # one row: the int8 kernel
    assert kernel == [1] * x.shape[1]
    want = torch.nn.functional.linear(x, exact, linear.bias)
    for got in (together, one_by_one):  # bf16 activations and outputs: within bf16's rounding of the exact product
        assert (got - want).norm() / want.norm() < 0.01
    assert (together - one_by_one).norm() / want.norm() < 0.01


def test_int8_gives_each_prompt_token_a_scale_of_its_own():
    """A quiet token beside a loud one keeps its precision (one scale for the whole call would leave it ~1 level)."""
    torch.manual_seed(0)
    linear = quant._dynamic_int8(torch.nn.Linear(256, 64, bias=True))
    x = torch.randn(4, 256)
    x[0] *= 100
    want = torch.nn.functional.linear(x, linear.weight().dequantize(), linear.bias)
    error = ((linear(x) - want).norm(dim=-1) / (want - linear.bias).norm(dim=-1))[1:]
    assert (error < 0.05).all() and (error > 1e-4).all()  # close, and still quantized


def test_int8_decodes_one_row_with_fbgemms_own_call():
    torch.manual_seed(0)
    linear = quant._dynamic_int8(torch.nn.Linear(256, 64, bias=True))
    x = torch.randn(1, 1, 256) * 30
    packed = torch.ops.quantized.linear_prepack(quant.at_scale_one(linear.weight().int_repr()), None)
    assert torch.equal(linear(x), torch.ops.quantized.linear_dynamic(x, packed, True) * linear.scale + linear.bias)


def test_int8_scales_fbgemms_output_by_each_rows_scale_as_its_per_channel_linear_would():
    """Packed at scale 1 (quicker to pack), each row's scale multiplies the output: fbgemm's per-channel linear but for
    the rounding of one product."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 64, bias=False)
    with torch.no_grad():
        linear.weight.mul_(torch.logspace(-2, 2, 64)[:, None])  # rows of scales far apart
    linear = quant._dynamic_int8(linear)
    per_channel = torch.ops.quantized.linear_prepack(linear.weight(), None)
    assert all(torch.ops.quantized.linear_unpack(p)[0].qscheme() == torch.per_tensor_affine for p in linear.parts)
    for rows in (1, 7):
        x = torch.randn(rows, 256)
        want = torch.ops.quantized.linear_dynamic(x, per_channel, True)
        assert torch.allclose(linear._matmul(x), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, quant.DECODE_ROWS])
def test_w8a14_reads_each_decode_row_to_14_bits_against_the_int8_weights(rows, kernels):
    """Two parts of 63 levels a side, high and what it rounded off, leave each value within half a level of 63 * 126
    over its row's peak: the int8 weights' product with the row nearly exactly, where one part (int8) is ~126x off.
    Split by torch's ops or by the numba kernel (qvl.engine.jit)."""
    torch.manual_seed(0)
    linear = quant._dynamic_int8(torch.nn.Linear(256, 64, bias=True))
    x = torch.randn(1, rows, 256)
    x[0, 0] *= 100  # a loud token beside quiet ones: each row has its own peak
    weight = linear.weight().dequantize()
    want = torch.nn.functional.linear(x, weight, linear.bias)
    half_level = x.abs().amax(-1, keepdim=True) / (63 * 126 * 2)
    bound = half_level * weight.abs().sum(1) + 1e-4 * want.abs()  # the rounding, and fp32's summation
    one_part = linear(x)
    linear.two_part = True
    two_parts = linear(x)
    assert ((two_parts - want).abs() <= bound).all()
    assert ((one_part - want).abs() > 10 * bound).any()  # which the single part is far from
    assert kernels[1] == (["in_two_parts"] if kernels[0] == "jit" else [])


@pytest.mark.parametrize("kernels", ["jit"], indirect=True)
def test_the_numba_split_gives_torchs_split_of_a_row(kernels):
    """The kernel and torch's ops quantize to the same whole numbers: outputs equal but for the join's rounding."""
    torch.manual_seed(0)
    linear = quant._dynamic_int8(torch.nn.Linear(256, 64, bias=False))
    linear.two_part = True
    x = torch.randn(3, 256) * torch.tensor([[1.0], [100.0], [0.0]])  # a quiet row, a loud one, and all zeros
    ready = jit.ready
    ready.clear()
    plain = linear(x)
    ready.set()
    fast = linear(x)
    assert kernels[1] == ["in_two_parts"] and torch.allclose(fast, plain, rtol=1e-6, atol=0) and not fast[2].any()
    parts, onednns = torch.empty(6, 256), torch.empty(6, 256, dtype=torch.uint8)
    levels = jit._split(x.numpy(), parts.numpy(), np.float32(0))
    assert torch.equal(parts, quant.Int8Linear._split(x)[0]) and levels.shape == (3, 1)
    assert parts.abs().max() <= 63 and torch.equal(parts, parts.round())  # whole numbers, which fbgemm keeps exactly
    jit._split(x.numpy(), onednns.numpy(), np.float32(64))
    assert torch.equal(onednns.int() - 64, parts.int())  # oneDNN's uint8 input, at zero point 64


AVX2_KERNEL = """
import os
os.environ["FBGEMM_ENABLE_INSTRUCTIONS"] = "AVX2"  # fbgemm's AVX2 kernel on any CPU: what an AVX2-only one runs
import torch
from qvl.engine import quant
torch.manual_seed(0)
linear = quant._dynamic_int8(torch.nn.Linear(512, 64, bias=False))
exact = lambda q: q.double() @ linear.weight().int_repr().double().T  # its parts are packed at scale 1
loudest = torch.full((2, 512), 63.0)
print((quant._whole_numbers(loudest, linear.parts[0], False).double() - exact(loudest)).abs().max().item())
eight_bits = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(loudest * 2 + 1, 1.0, 128, linear.parts[0])
print((eight_bits.double() - exact(loudest * 2 + 1)).abs().max().item())
"""


def test_w8a14s_parts_fit_the_headroom_of_fbgemms_avx2_kernel(python_child):
    """Its kernel adds pairs of uint8 x int8 products in int16: whole numbers in [-63, 63] (7 bits at zero point 64)
    come out exact, where 8-bit inputs saturate, as the second figure shows (so the AVX2 kernel did run)."""
    child = python_child(AVX2_KERNEL)
    two_parts, eight_bits = map(float, child.stdout.split())
    assert two_parts < 1e-3 and eight_bits > 1, child.stderr[-2000:]


@pytest.mark.parametrize("flags, auto", [(frozenset({"AVX2"}), "fbgemm"), (frozenset({"AVX2", "AVX-512", "VNNI"}), "fbgemm"),
                                         (frozenset({"AVX2", "AVX-512", "VNNI", "BF16"}), "fbgemm"),
                                         (frozenset({"AVX2", "AVX-512", "VNNI", "BF16", "AMX"}), "onednn")])
def test_auto_is_onednns_int8_kernel_on_amx_and_fbgemms_elsewhere_and_a_named_one_is_kept(flags, auto):
    """On an AMX Xeon oneDNN's kernel prefilled the 2B's prompt on the tiles several times faster and decoded as fast
    as fbgemm's; elsewhere it is unmeasured, or cannot run (AVX2 alone)."""
    assert [modes.kernel(choice, flags) for choice in ("auto", "fbgemm", "onednn")] == [auto, "fbgemm", "onednn"]


@pytest.mark.parametrize("flags, refused", [(frozenset({"AVX2"}), True), (frozenset({"AVX2", "AVX-512"}), True),
                                            (frozenset({"AVX2", "AVX-512", "VNNI"}), False),
                                            (frozenset({"AVX2", "AMX"}), False)])
def test_onednn_is_refused_at_start_where_its_8_bit_activations_would_overflow(monkeypatch, capsys, flags, refused):
    monkeypatch.setattr(cpu, "flags", lambda text=None: flags)
    monkeypatch.setattr(cpu, "arm", lambda machine=None: False)
    if refused:
        with pytest.raises(SystemExit):
            settings.parse(["--int8-kernel", "onednn"], env={})
        assert "onednn's int8 kernel needs AVX-512 VNNI or AMX, which this CPU lacks" in capsys.readouterr().err
    else:
        assert settings.parse(["--int8-kernel", "onednn"], env={}).kernel == "onednn"
    assert settings.parse([], env={"QVL_INT8_KERNEL": "fbgemm"}).kernel == "fbgemm"
    assert settings.parse([], env={}).kernel == ("onednn" if "AMX" in flags else "fbgemm")


@pytest.mark.parametrize("kernels", ["torch", "jit", "vnni"], indirect=True)
def test_onednn_decodes_w8a14_rows_exactly_as_fbgemm_and_prefills_no_farther_from_the_float_layer(onednn, kernels,
                                                                                                   monkeypatch):
    """A decode row's two parts are whole numbers, which both kernels multiply exactly: the same output bit for bit.
    A prompt's rows take oneDNN's 8-bit activations, where fbgemm's take 7."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(512, 96, bias=True)
    ours = quant._dynamic_int8(layer)
    quant.use_kernel("fbgemm")
    theirs = quant._dynamic_int8(layer)
    assert ours.onednn and not theirs.onednn
    x = torch.randn(1, 40, 512)
    assert all(part.layout == torch._mkldnn for part in ours.parts)  # oneDNN's own packed weight: only it reads them
    want = layer(x)
    assert (ours(x) - want).norm() < 0.75 * (theirs(x) - want).norm()
    ours.two_part = theirs.two_part = True
    took = []
    whole_numbers = quant._whole_numbers
    monkeypatch.setattr(quant, "_whole_numbers", lambda q, *args: took.append(q.dtype) or whole_numbers(q, *args))
    for rows in (1, quant.DECODE_ROWS):
        assert torch.equal(ours(x[:, :rows]), theirs(x[:, :rows]))
    # oneDNN's prompt too; vnni's kernel reads oneDNN's weights itself for one row, fbgemm's go through jit's split.
    assert kernels[1] == {"torch": [], "jit": ["levels"] + ["in_two_parts"] * 4,
                          "vnni": ["levels", "linear"] + ["in_two_parts"] * 3}[kernels[0]]
    # The numba split writes oneDNN's uint8 input itself; torch's split gives float parts to quantize (and fbgemm's).
    assert took == {"torch": [torch.float32] * 4, "jit": [torch.uint8, torch.float32] * 2,
                    "vnni": [torch.float32, torch.uint8, torch.float32]}[kernels[0]]


@pytest.mark.parametrize("kernels", ["vnni"], indirect=True)
@pytest.mark.parametrize("parts", [1, 2])
def test_vnnis_kernel_reads_onednns_packed_weights_to_its_decode_rows_bit_for_bit(onednn, kernels, parts):
    """qvl's decode kernel reads oneDNN's packed weights where they lie: whole and in pieces whose channels do not
    fill its last block of 64, weights in two parts, each the same output as oneDNN's own call, and with loud channels
    apart within float rounding (their products are summed in the kernel's order, not addmm's). It takes up to
    vnni.ROWS decode rows (more keep oneDNN's call, faster there) and weights it can read: an input width no multiple
    of 64 keeps oneDNN's call."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(512, 150, bias=True)
    linear = quant._dynamic_int8(layer, parts=parts)
    pieces = quant.Int8Linear(torch.cat(list(linear.pieces())), linear.scale, layer.bias.detach(), rows=100,
                              parts=parts)
    pieces.set_apart(torch.tensor([3, 77]), torch.randn(2, 150))
    odd = quant._dynamic_int8(torch.nn.Linear(520, 96))
    x = torch.randn(1, quant.DECODE_ROWS, 520) * torch.logspace(-2, 1, quant.DECODE_ROWS)[:, None]
    for ours in (linear, pieces, odd):
        ours.two_part = True
        for rows in (1, 2, vnni.ROWS, vnni.ROWS + 1):
            kernels[1].clear()
            got = ours(x[:, :rows, :ours.in_features])
            assert kernels[1] == ["in_two_parts" if ours is odd or rows > vnni.ROWS else "linear"]
            vnni.ready = False  # oneDNN's own call (the fixture puts it back)
            want = ours(x[:, :rows, :ours.in_features])
            assert kernels[1][-1] == "in_two_parts"
            if ours is pieces and rows <= vnni.ROWS:
                assert torch.allclose(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
            else:
                assert torch.equal(got, want)
            vnni.ready = True
    assert len(pieces.parts) == (2 if parts == 1 else 3) and not vnni.fits(odd.parts[0])
    replaced, want = weakref.ref(pieces.parts[0]), pieces(x[:, :1, :512])
    while pieces.settle():
        pass
    assert replaced() is None  # the kernel's table of the pieces lets them go once settled
    kernels[1].clear()
    assert torch.equal(pieces(x[:, :1, :512]), want) and kernels[1] == ["linear"]


@pytest.mark.parametrize("parts", [1, 2])
def test_onednns_prompt_rows_are_each_quantized_at_their_own_peak_and_scaled_in_the_kernel(onednn, monkeypatch, parts):
    """Each prompt row over its peak in 127 levels a side, whole-number products with the int8 weight, times the
    weight row's scale and the row's level: in pieces and with weights in two parts alike, and without _dynamic's
    search for one scale (the rows' peaks are known to be 1)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(512, 96, bias=True)
    linear = quant._dynamic_int8(layer, parts=parts)
    pieces = quant.Int8Linear(torch.cat(list(linear.pieces())), linear.scale, layer.bias.detach(), rows=32,
                              parts=parts)
    assert len(pieces.parts) == 3 * parts
    x = torch.randn(1, 40, 512) * torch.logspace(-2, 1, 40)[:, None]  # rows of very different loudness
    level = x.abs().amax(-1, keepdim=True).double() / 127
    q = (x / level).round()
    exact = (q.double() @ torch.cat(list(linear.pieces())).double().T) * linear.scale.double() * level
    want = exact.view(1, 40, parts, 96).sum(2) + layer.bias.double()
    monkeypatch.setattr(quant, "_dynamic", lambda *_: pytest.fail("a prompt's rows took _dynamic's path"))
    for ours in (linear, pieces):
        assert torch.allclose(ours(x).double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("kernels", ["jit"], indirect=True)
def test_once_warm_a_prompts_rows_are_quantized_for_onednn_by_one_kernel_bit_for_bit(onednn, kernels):
    """jit.levels makes the uint8 levels and peaks that torch's five ops make, loud and silent rows and a width
    that is no multiple of the kernel's 16 lanes included, so the linear's output is the same bit for bit."""
    torch.manual_seed(0)
    linear = quant._dynamic_int8(torch.nn.Linear(520, 96))
    x = torch.randn(1, 41, 520) * torch.logspace(-3, 2, 41)[:, None]
    x[0, 7] = 0
    x[0, 9, 515] = -1e3  # its peak in the last lanes
    levels, peaks = jit.levels(x)
    want = x.abs().amax(-1, keepdim=True).clamp_(min=torch.finfo(x.dtype).tiny)
    assert torch.equal(peaks, want) and peaks.shape == (1, 41, 1)
    assert torch.equal(levels, torch.quantize_per_tensor(x / want, 1 / 127, 128, torch.quint8).int_repr())
    kernels[1].clear()
    ours = linear(x)
    assert kernels[1] == ["levels"]
    jit.ready.clear()  # torch's ops
    assert torch.equal(ours, linear(x)) and kernels[1] == ["levels"]


def test_an_onednn_engine_says_so_and_answers_no_farther_from_fp32_than_the_fbgemm_one(tiny_dir, tmp_path, onednn):
    """Its precision (the answer cache's key) names oneDNN, its linears are oneDNN's, and its logits for the standard
    request, fed fp32's answer, are no farther from fp32's than fbgemm's."""
    request = [Turn("user", bench.QUESTION, (bench.photo(),))]

    def answer(*flags, tokens=None):
        engine = Engine(settings.parse(["--model", str(tiny_dir), "--no-cache", "--no-model-cache", "--cache-dir",
                                        str(tmp_path), "--kv-memory", "0", *flags], env={}))
        logits, _, tokens = bench.forced_chat(engine, request, tokens, 12)
        kinds = {m.onednn for m in engine.model.modules() if isinstance(m, quant.Int8Linear)}
        engine.close()
        return logits, tokens, engine.precision, kinds

    want, tokens, _, _ = answer("--quant", "fp32")
    ours, _, precision, kinds = answer("--quant", "w8a14", "--int8-kernel", "onednn", "--vision-dtype", "fp32",
                                       tokens=tokens)
    assert "oneDNN int8 linears" in precision and "fbgemm" not in precision and kinds == {True}
    theirs, _, precision, kinds = answer("--quant", "w8a14", "--int8-kernel", "fbgemm", "--vision-dtype", "fp32",
                                         tokens=tokens)
    assert "fbgemm int8 linears" in precision and kinds == {False}
    near, far = bench.fidelity(ours, want)["sqnr_db"], bench.fidelity(theirs, want)["sqnr_db"]
    # Each linear is nearer (the test above). The tower computes in fp32 around its int8 linears in both, so they are
    # the kernel's too (in bf16 it would hold no int8 linear, and a bf16 rounding would decide): 39.31 against 38.55
    # dB here; through the tiny model's few layers chance could reverse that, on the 2B oneDNN's 0.3 dB nearer.
    assert 60 > near >= far - 0.25, (near, far)


def test_w8a14_prefills_a_prompt_as_int8_does():
    """A prompt's rows are bound by computing them: twice the rows would cost the first token ~40% for 0.4 dB."""
    torch.manual_seed(0)
    linear = quant._dynamic_int8(torch.nn.Linear(256, 64, bias=True))
    x = torch.randn(1, quant.DECODE_ROWS + 1, 256)
    one_part = linear(x)
    linear.two_part = True
    assert torch.equal(linear(x), one_part)


def test_w8a14_splits_the_text_activations_and_leaves_the_vision_towers_prefill_as_int8s(tiny_dir):
    model = checkpoint.load_model(str(tiny_dir), "w8a14")
    split = {name: module.two_part for name, module in model.named_modules() if isinstance(module, quant.Int8Linear)}
    assert {name for name, two in split.items() if two} == {name for name in split if not name.startswith("model.visual.")}
    assert any(name.startswith("model.visual.") for name in split) and "lm_head" in split


@pytest.mark.parametrize("rows", [1, quant.DECODE_ROWS, 40])  # decode rows (w8a14's two parts), a prompt
def test_weights_in_two_int8_parts_compute_as_the_two_linears_of_their_parts_would(rows, kernels):
    """parts=2: each weight row as its int8 levels and what they rounded off, each part with its own row scales, in
    one fbgemm call whose two halves are summed: the output of the two parts' own linears, and as the float
    weights' over 20x nearer than one part where the activations keep 14 bits (w8a14's decode rows)."""
    torch.manual_seed(0)
    float_linear = torch.nn.Linear(256, 64, bias=True)
    one, two = quant._dynamic_int8(float_linear), quant._dynamic_int8(float_linear, parts=2)
    assert two.weight_parts == 2 and two.out_features == 64 and len(two.scale) == 128
    values = torch.cat(list(two.pieces()))
    levels = quant.Int8Linear(values[:64], two.scale[:64], two.bias)
    rounded_off = quant.Int8Linear(values[64:], two.scale[64:], None)
    assert torch.equal(levels.weight().int_repr(), one.weight().int_repr())
    for linear in (one, two, levels, rounded_off):
        linear.two_part = True
    x = torch.randn(1, rows, 256)
    x[0, 0] *= 100  # each row has its own peak
    with torch.no_grad():
        want = float_linear(x)
    assert torch.allclose(two(x), levels(x) + rounded_off(x), rtol=1e-5, atol=1e-5)
    if rows <= quant.DECODE_ROWS:
        assert (two(x) - want).norm() < (one(x) - want).norm() / 20  # ~38x: the 14-bit activations remain
    assert set(kernels[1]) == ({"in_two_parts"} if kernels[0] == "jit" and rows <= quant.DECODE_ROWS else set())


def test_w8a14_keeps_the_first_text_layers_weights_in_two_parts_which_brings_its_logits_nearer_fp32s(tiny_dir,
                                                                                                    monkeypatch):
    """An error in the first layers runs through every layer after them (the 2B's text logits, modes.TWO_PART_LAYERS:
    21.3 -> 28.3 dB with two of its 28 layers so kept); int8 keeps one part (its 7-bit activations cost it more)."""
    ids = torch.randint(0, 256, (1, quant.DECODE_ROWS), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = checkpoint.load_model(str(tiny_dir), "fp32")(input_ids=ids).logits

        def error(mode):
            model = checkpoint.load_model(str(tiny_dir), mode)
            parts = {name: m.weight_parts for name, m in model.named_modules() if isinstance(m, quant.Int8Linear)}
            return (model(input_ids=ids).logits - want).norm().item(), parts

        kept, parts = error("w8a14")
        first = tuple(f"model.language_model.layers.{i}." for i in range(modes.TWO_PART_LAYERS))
        assert {name for name, n in parts.items() if n == 2} == {name for name in parts if name.startswith(first)}
        assert any(name.startswith(first) for name in parts) and parts["lm_head"] == 1  # the tiny's 2 layers
        assert set(error("int8")[1].values()) == {1}
        monkeypatch.setattr(modes, "TWO_PART_LAYERS", 0)
        one_part, parts = error("w8a14")
        assert set(parts.values()) == {1} and kept < one_part / 1.4  # 5.4 dB nearer on the tiny model


@pytest.mark.parametrize("rows", [1, 5, 40])  # a decode step; a prompt (w8a16: its bf16 GEMM above W8A16_ROWS)
@pytest.mark.parametrize("kind", ["int8", "w8a16", "w8a14"])
def test_loud_channels_are_computed_apart_against_the_checkpoints_weights(kind, rows):
    """Channels set apart leave the int8 path (zeros in fbgemm's input, or in w8a16's weight) and come back as an fp32
    product with the float weights' columns: a channel 100x the rest no longer takes the others' precision (int8),
    and its reader's small weights are no longer rounded to a row's int8 levels (w8a16)."""
    torch.manual_seed(0)
    float_linear = torch.nn.Linear(256, 64, bias=True)
    loud = torch.tensor([3, 77])
    with torch.no_grad():
        float_linear.weight[:, loud] /= 50  # as outliers' readers have them
    convert = {"int8": quant._dynamic_int8, "w8a14": quant._dynamic_int8, "w8a16": quant.Int8WeightOnly.quantize}[kind]
    linear, plain = convert(float_linear), convert(float_linear)
    linear.two_part = plain.two_part = kind == "w8a14"
    x = torch.randn(1, rows, 256)
    x[..., loud] *= 100
    with torch.no_grad():
        want = float_linear(x)

    def error(module):
        return ((module(x) - want).norm() / (want - float_linear.bias).norm()).item()

    columns = float_linear.weight.detach()[:, loud].T
    linear.set_apart(loud, columns)
    if kind == "w8a16":
        assert (linear.int8_weight[:, loud] == 0).all() and (linear.int8_weight[:, 4] != 0).any()
        quiet_path = quant.Int8WeightOnly(linear.int8_weight, linear.scale, linear.bias)(x)
    else:
        quiet_path = plain(x.index_fill(-1, loud, 0))
    assert torch.allclose(linear(x), quiet_path + x[..., loud] @ columns, atol=1e-4)
    assert error(linear) < error(plain) / 3 and error(linear) < 0.02


@pytest.mark.parametrize("mode", ["int8", "int4", "w8a16", "w8a14"])
def test_converting_sets_apart_the_planted_loud_channels_with_the_checkpoints_weights(loud_dir, tiny_dir, mode):
    from safetensors.torch import load_file

    folder, planted = loud_dir
    model = checkpoint.load_model(str(folder), mode)
    heads = model.config.text_config.head_dim
    linears = {name.removeprefix("model.language_model.").removesuffix(".prefill"): module
               for name, module in model.named_modules() if getattr(module, "apart", None) is not None}
    want = {}
    for i, (values, inner) in enumerate(zip(planted["values"], planted["mlp"])):
        want[f"layers.{i}.self_attn.qkv_proj"] = want[f"layers.{i}.mlp.gate_up_proj"] = planted["residual"]
        want[f"layers.{i}.self_attn.o_proj"] = sorted(c // heads * 2 * heads + g * heads + c % heads  # its 2 readers
                                                     for c in values for g in range(2))
        want[f"layers.{i}.mlp.down_proj"] = inner
    assert {name: m.apart.tolist() for name, m in linears.items()} == want  # int4: its int8 prefill twins
    weights = load_file(folder / "model.safetensors")
    layer = "model.language_model.layers.1"
    qkv = torch.cat([weights[f"{layer}.self_attn.{p}_proj.weight"] for p in "qkv"])[:, planted["residual"]]
    assert torch.equal(linears["layers.1.self_attn.qkv_proj"].columns, qkv.T.float())
    down = weights[f"{layer}.mlp.down_proj.weight"][:, planted["mlp"][1]]
    assert torch.equal(linears["layers.1.mlp.down_proj"].columns, down.T.float())
    plain = checkpoint.load_model(str(tiny_dir), mode)  # random weights: no channel stands out
    assert not any(getattr(m, "apart", None) is not None for m in plain.modules())


def test_loud_channels_whose_weights_the_checkpoint_does_not_name_stay_in_the_int8_path(loud_dir, monkeypatch, caplog):
    folder, planted = loud_dir
    model = checkpoint.load_model(str(folder), "fp32")
    loud = {"model.language_model.layers.0.mlp.down_proj": torch.tensor(planted["mlp"][0]),
            "model.language_model.layers.0.mlp.odd_proj": torch.tensor([1])}
    assert list(checkpoint.checkpoint_columns(model, str(folder), loud)) == ["model.language_model.layers.0.mlp.down_proj"]
    monkeypatch.setattr(checkpoint, "checkpoint_columns", lambda *args: {})  # a layout whose names it does not know
    model = checkpoint.load_model(str(folder), "int8")
    assert "its loud channels stay in the int8 path" in caplog.text
    assert not any(getattr(m, "apart", None) is not None for m in model.modules())


@pytest.mark.parametrize("mode, gain", [("int8", 10), ("w8a16", 3), ("w8a14", 3)])
def test_loud_channels_apart_keep_the_planted_models_logits(loud_dir, monkeypatch, mode, gain):
    from qvl.tools import bench

    folder, _ = loud_dir
    reference, model = checkpoint.load_model(str(folder), "fp32"), checkpoint.load_model(str(folder), mode)
    monkeypatch.setattr(checkpoint, "set_loud_channels_apart", lambda *args: None)
    together = checkpoint.load_model(str(folder), mode)
    assert any(getattr(m, "apart", None) is not None for m in model.modules())
    assert not any(getattr(m, "apart", None) is not None for m in together.modules())
    ids = torch.randint(0, 256, (1, 96), generator=torch.Generator().manual_seed(5))  # not the calibration's tokens
    with torch.inference_mode():
        want = reference(input_ids=ids).logits[0]
        apart = bench.fidelity(model(input_ids=ids).logits[0], want)
        without = bench.fidelity(together(input_ids=ids).logits[0], want)
    assert apart["sqnr_db"] > without["sqnr_db"] + gain and apart["top1_agreement"] > 0.85


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_weights_are_each_rows_values_over_its_peak_rounded_to_127_levels(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(2048, 600, bias=False, dtype=dtype)  # more rows than one slice (512 of 2048 values)
    with torch.no_grad():
        linear.weight[7] = 0  # a row of zeros
        linear.weight[599, 3] = 1000  # one outlier sets its row's scale
    source = linear.weight.clone()
    weight = quant._dynamic_int8(linear).weight()
    assert torch.equal(linear.weight, source)  # quantized from a copy
    w = linear.weight.float()
    scale = w.abs().amax(1).clamp(min=1e-8) / 127
    assert torch.equal(weight.q_per_channel_scales(), scale.double())
    assert torch.equal(weight.int_repr(), (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
    assert weight.int_repr().abs().amax(1).min() == 0 and weight.int_repr()[599, 3] == 127


def _int8(rows=100, columns=256) -> tuple[torch.Tensor, torch.Tensor]:
    """A random linear's int8 values and their rows' scales."""
    torch.manual_seed(0)
    weight = quant._dynamic_int8(torch.nn.Linear(columns, rows, bias=False)).weight()
    return weight.int_repr(), weight.q_per_channel_scales()


def test_fbgemm_packs_int8_values_from_their_own_memory_as_from_a_copy():
    values = torch.randint(-127, 128, (96, 64), dtype=torch.int8)
    weight = quant.at_scale_one(values)
    assert weight.data_ptr() == values.data_ptr()  # no copy (a start of the 2B made 2.1 B values' worth)
    copy = torch._make_per_tensor_quantized_tensor(values, 1.0, 0)
    assert weight.data_ptr() != copy.data_ptr() and torch.equal(weight.dequantize(), copy.dequantize())
    x = torch.randn(5, 64)
    linear = lambda w: torch.ops.quantized.linear_dynamic(x, torch.ops.quantized.linear_prepack(w, None), True)
    assert torch.equal(linear(weight), linear(copy))


def test_int8_pieces_give_the_whole_linears_output_bit_for_bit():
    values, scale = _int8()
    whole, pieces = quant.Int8Linear(values, scale, torch.randn(100)), quant.Int8Linear(values, scale, None, rows=16)
    pieces.bias = whole.bias
    assert len(pieces.parts) == 7 and torch.equal(pieces.weight().int_repr(), values)
    assert torch.equal(pieces.weight().q_per_channel_scales(), scale.float().double())
    for rows in (1, 16):
        x = torch.randn(rows, 256)
        assert torch.equal(pieces(x), whole(x))


def test_settling_repacks_pieces_a_run_at_a_time_and_changes_no_output():
    linear = quant.Int8Linear(*_int8(), None, rows=16)  # 100 rows: 7 pieces
    x = torch.randn(5, 256)
    before = linear(x)
    assert linear.settle(rows=64) and len(linear.parts) == 4  # the first four pieces are one
    assert torch.equal(linear(x), before)
    assert linear.settle(rows=64) and len(linear.parts) == 2  # and the last three
    assert not linear.settle(rows=64) and torch.equal(linear(x), before)
    assert torch.equal(linear.weight().int_repr(), _int8()[0])
    whole = quant.Int8Linear(*_int8(), None, rows=16)
    while whole.settle():
        pass
    assert len(whole.parts) == 1 and torch.equal(whole(x), before)
    assert not quant.Int8Linear(*_int8(), None).settle()  # loaded whole: nothing to do


def _sharp(model):
    """Random weights with large logits, so greedy answers vary token by token (the tiny model's are flat)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


def test_lean_decode_loop_matches_hf_generate_greedily(tiny_dir, engine):
    from PIL import Image
    model = _sharp(checkpoint.load_model(str(tiny_dir), "fp32"))
    image = Image.radial_gradient("L").convert("RGB").resize((96, 64))
    inputs, _ = engine._inputs([Turn("user", "what is this?", (image,))], GenParams())
    params = GenParams(greedy=True, max_new_tokens=16, min_new_tokens=16)
    ours = list(generate.stream(model, inputs, params, threading.Event()))
    hf = model.generate(**inputs, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert ours == hf[0, inputs["input_ids"].shape[1]:].tolist()
    assert len(set(ours)) > 1  # a constant answer would not test the cache positions


def test_sampling_is_reproducible_per_seed_and_stops_at_eos(tiny_dir, engine):
    model = _sharp(checkpoint.load_model(str(tiny_dir), "fp32"))
    inputs, _ = engine._inputs([Turn("user", "hello there")], GenParams())
    eos = model.generation_config.eos_token_id
    run = lambda seed: list(generate.stream(model, inputs, GenParams(seed=seed, max_new_tokens=40), threading.Event()))
    assert run(3) == run(3)
    assert any(run(3) != run(s) for s in (4, 5, 6))
    for seed in range(8):
        answer = run(seed)
        assert all(t not in eos for t in answer[:-1])  # nothing is generated after an end-of-sequence token


def test_stop_event_and_closing_end_generation_within_one_step(tiny_dir, engine, monkeypatch):
    inputs, _ = engine._inputs([Turn("user", "hello")], GenParams())
    params = GenParams(greedy=True, max_new_tokens=50, min_new_tokens=50)
    stop = threading.Event()
    tokens = []
    for token in generate.stream(engine.model, inputs, params, stop):
        tokens.append(token)
        if len(tokens) == 3:
            stop.set()
    assert len(tokens) == 3
    calls = []
    model, forward, step = engine.model, generate._forward, lean.Decoder.step
    monkeypatch.setattr(generate, "_forward", lambda model, **kw: calls.append("prefill") or forward(model, **kw))
    monkeypatch.setattr(lean.Decoder, "step", lambda self, token: calls.append("step") or step(self, token))
    it = generate.stream(model, inputs, params, threading.Event())
    next(it), next(it)
    it.close()
    assert calls == ["prefill", "step"]  # none after the close


def _logits(model):
    checkpoint._float_rest(model)
    with torch.inference_mode():
        return model(input_ids=torch.tensor([[1, 2, 3, 4, 5]])).logits


def test_the_streamed_load_builds_the_same_model_as_converting_a_whole_load(tiny_dir):
    from transformers import AutoModelForImageTextToText

    streamed = checkpoint._load_converting(str(tiny_dir), checkpoint._int8)
    whole = AutoModelForImageTextToText.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    lean.fuse(whole)
    checkpoint._replace_linears(whole, checkpoint._int8)
    assert torch.equal(_logits(streamed), _logits(whole))
    assert not any(isinstance(m, torch.nn.Linear) for m in streamed.modules())  # the tied head too


def test_an_unknown_checkpoint_layout_is_loaded_whole_instead(tiny_dir, tmp_path, caplog):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_dir, tmp_path / "odd")
    weights = load_file(tiny_dir / "model.safetensors")
    save_file({**weights, "model.extra_projection.weight": torch.zeros(2, 2)}, tmp_path / "odd" / "model.safetensors")
    with pytest.raises(KeyError, match="extra_projection"):
        checkpoint._load_converting(str(tmp_path / "odd"), checkpoint._int8)
    model = checkpoint.load_model(str(tmp_path / "odd"), "int8")
    assert "loading the checkpoint whole" in caplog.text and isinstance(model.lm_head, quant.Int8Linear)
    assert _logits(model).shape[-1] == model.config.text_config.vocab_size


def test_linears_convert_side_by_side_in_order_with_a_bounded_number_in_flight():
    both_running = threading.Barrier(2, timeout=10)  # broken (an error) unless two jobs run at the same time
    started = []

    def job(i):
        started.append(i)
        if i < 2:
            both_running.wait()
        return i * i

    results = []
    for name, value in checkpoint.side_by_side(((f"linear{i}", lambda i=i: job(i)) for i in range(6)), workers=2):
        results.append((name, value))
        assert len(started) <= len(results) + 2  # at most workers + 1 in flight, counting the one handed back
    assert results == [(f"linear{i}", i * i) for i in range(6)]


def _read_back(layer):
    """layer's stored tensors as the model cache reads them back: each whole, a copy."""
    return {name: chunks.clone() if isinstance(chunks, torch.Tensor) else torch.cat(list(chunks))
            for name, chunks in layer.to_tensors()}


@pytest.mark.parametrize("mode, kinds", [
    ("int8", {quant.Bf16Embedding, quant.Int8Linear}),
    ("w8a14", {quant.Bf16Embedding, quant.Int8Linear}),
    ("int4", {quant.Bf16Embedding, quant.Int8Linear, quant.Int4Linear}),  # vision int8, text int4 with int8 twins
    ("w8a16", {quant.Bf16Embedding, quant.Int8WeightOnly}),
])
def test_every_quantized_layer_built_from_its_stored_tensors_answers_exactly_as_it_did(tiny_dir, loud_dir, mode,
                                                                                        kinds):
    torch.manual_seed(0)
    for folder in (tiny_dir, loud_dir[0]):  # the loud model's text linears compute channels apart
        model = checkpoint.load_model(str(folder), mode)
        layers = {name: m for name, m in model.named_modules() if isinstance(m, quant.Stored)}
        assert {type(layer) for layer in layers.values()} == kinds
        for name, layer in layers.items():
            rebuilt = type(layer).from_tensors(_read_back(layer))
            assert type(rebuilt) is type(layer)
            if isinstance(layer, quant.Bf16Embedding):
                ids = torch.arange(layer.weight.shape[0])
                assert torch.equal(rebuilt(ids), layer(ids)), name
                continue
            # A decode row, w8a14's decode rows in two parts, a prompt (int4's int8 twin, a scale per token).
            for rows in (1, quant.DECODE_ROWS, 3 * quant.DECODE_ROWS):
                x = torch.randn(rows, layer.in_features)
                assert torch.equal(rebuilt(x), layer(x)), (name, rows)
    assert any(getattr(layer, "apart", None) is not None for layer in layers.values())
    if mode == "w8a14":  # what it adds to int8's layers came back too
        int8 = [layer for layer in layers.values() if isinstance(layer, quant.Int8Linear)]
        assert any(layer.two_part for layer in int8) and any(layer.weight_parts == 2 for layer in int8)


@pytest.mark.parametrize("flags, auto", [(frozenset({"AVX2"}), "fp32"), (frozenset({"AVX2", "AVX-512", "VNNI", "BF16"}), "fp32"),
                                         (frozenset({"AVX2", "AVX-512", "VNNI", "BF16", "AMX"}), "int8")])
def test_auto_computes_a_quantized_vision_tower_in_bf16_around_int8_linears_on_amx_and_in_fp32_elsewhere(flags, auto):
    """On an AMX Xeon the 2B's tower ran twice as fast in bf16 as in fp32 (its matmuls and attention on the tiles),
    and faster again with its linears on int8 activations; AVX-512 BF16 without AMX is unmeasured, and elsewhere bf16
    is emulated. fp32 and bf16 keep their own dtype."""
    assert [modes.vision("auto", mode, flags) for mode in ("w8a14", "int8", "int4")] == [auto] * 3
    # w8a16 quantizes no activation: its linears read their weights as bf16 in a bf16 tower.
    assert modes.vision("auto", "w8a16", flags) == ("bf16" if auto == "int8" else auto)
    assert modes.vision("int8", "w8a16", flags) == "bf16"
    assert [modes.vision(choice, "w8a14", flags) for choice in modes.VISION_DTYPES] == ["fp32", "bf16", "int8"]
    assert [modes.vision(choice, mode, flags) for choice in ("auto", *modes.VISION_DTYPES)
            for mode in ("fp32", "bf16")] == ["fp32", "bf16"] * 4
    assert [modes.bf16_tower(vision) for vision in modes.VISION_DTYPES] == [False, True, True]


@pytest.mark.parametrize("mode", ["w8a14", "int4"])
def test_a_bf16_vision_tower_computes_in_bf16_says_so_and_is_no_farther_from_fp32_than_the_fp32_tower(
        tiny_dir, tmp_path, mode):
    """--vision-dtype bf16: the tower's linears read their int8 weights as bf16, and its blocks compute in bf16, as
    the text decoder's attention over a prompt (its keys and values kept as --kv-dtype says, fp32 here, for the
    decode steps); the precision (the answer and feature caches' key) names it, and the logits for the standard
    request, fed fp32's answer, are no farther from fp32's than with the tower in fp32 around its int8 linears and
    the attention in fp32."""
    request = [Turn("user", bench.QUESTION, (bench.photo(),))]
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def answer(*flags, tokens=None):
        engine = Engine(settings.parse(["--model", str(tiny_dir), "--no-cache", "--no-model-cache", "--cache-dir",
                                        str(tmp_path), "--kv-memory", "0", *flags], env={}))
        dtypes, text = [], []
        engine.model.model.visual.blocks[0].register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))

        def attend(module, q, k, v, *args, **kwargs):
            if isinstance(module, lean.Attention):
                text.append((q.dtype, k.dtype, v.dtype))
            return sdpa(module, q, k, v, *args, **kwargs)

        with mock.patch.dict(ALL_ATTENTION_FUNCTIONS, {"sdpa": attend}):
            logits, _, tokens = bench.forced_chat(engine, request, tokens, 12)
        inputs = engine._inputs(request, settings.GenParams())[0]
        positions, delta = generate.positions(engine.model, inputs)
        prefilled = generate.Answer(engine.model, {**inputs, "position_ids": positions}, settings.GenParams(),
                                    threading.Event(), delta)
        kept = prefilled.decoder.keys[0].dtype  # what the decode steps attend over
        engine.close()
        return logits, tokens, engine.precision, set(dtypes), set(text), kept

    want, tokens, *_ = answer("--quant", "fp32")
    ours, _, precision, dtypes, text, kept = answer("--quant", mode, "--vision-dtype", "bf16", "--kv-dtype", "fp32",
                                                    tokens=tokens)
    assert "vision tower and a prompt's attention in bf16" in precision and dtypes == {torch.bfloat16}
    assert text == {(torch.bfloat16,) * 3} and kept == torch.float32
    theirs, _, precision, dtypes, text, kept = answer("--quant", mode, "--vision-dtype", "fp32", "--kv-dtype", "fp32",
                                                      tokens=tokens)
    assert "in bf16" not in precision and dtypes == {torch.float32} and text == {(torch.float32,) * 3}
    near, far = bench.fidelity(ours, want)["sqnr_db"], bench.fidelity(theirs, want)["sqnr_db"]
    assert 60 > near >= far - 0.1, (near, far)


@pytest.mark.parametrize("kernels", ["jit"], indirect=True)
def test_once_warm_a_bf16_towers_rows_are_quantized_at_one_scale_by_one_kernel_bit_for_bit(kernels):
    """jit.tensor_levels makes the uint8 levels, scale and zero point that torch's ops make (quant.tensor_levels):
    from the least value to the largest, 0 within them, so gelu's outputs (mostly above 0) keep most of the 256
    levels; a width that is no multiple of the kernel's 16 lanes, all-negative, all-positive and all-zero inputs
    included. Neither quantizes rows of which one is over LOUD_ROWS times as loud as the median one."""
    torch.manual_seed(0)
    inputs = [torch.randn(41, 520) * 3, torch.nn.functional.gelu(torch.randn(30, 1024) * 2, approximate="tanh"),
              -torch.rand(3, 17), torch.rand(2, 5) + 4, torch.zeros(4, 16)]
    for x in (t.bfloat16() for t in inputs):
        q, level, zero = jit.tensor_levels(x, quant.LOUD_ROWS)
        theirs = quant.tensor_levels(x, quant.LOUD_ROWS)
        assert torch.equal(q, theirs[0]) and (level, zero) == theirs[1:]
        low, high = min(x.min().item(), 0), max(x.max().item(), 0)
        assert level == pytest.approx(max((high - low) / 255, torch.finfo(torch.float32).tiny), rel=1e-6)
        assert zero == round(-low / level) and q.dtype == torch.uint8
        if high > low:  # every value within half a level of its own
            assert ((q.float() - zero) * level - x.float()).abs().max() <= level * 0.5001
    assert kernels[1] == ["tensor_levels"] * len(inputs)
    assert inputs[1].min() < 0 and zero < 16  # gelu's: nearly all levels above 0
    x = torch.randn(41, 520).bfloat16()
    x[7] *= 3.5  # within LOUD_ROWS of the median row
    assert jit.tensor_levels(x, quant.LOUD_ROWS) is not None and quant.tensor_levels(x, quant.LOUD_ROWS) is not None
    x[7] *= 2
    assert jit.tensor_levels(x, quant.LOUD_ROWS) is None and quant.tensor_levels(x, quant.LOUD_ROWS) is None


@pytest.mark.parametrize("gelu", [False, True])
def test_a_bf16_towers_int8_linear_adds_its_bias_and_gelu_as_onednn_writes_bf16_from_the_exact_sums(onednn, gelu):
    """Int8Linear.bf16_rows on oneDNN: x quantized at one scale and zero point, and each output the exact sum of its
    int8 products times the scales, plus the bias, through gelu (tanh) where asked, rounded once to bf16; in pieces
    alike. Where a row is over LOUD_ROWS times as loud as the median one, or the weights are fbgemm's, the float32
    path at a scale per token, then the gelu and bf16."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(512, 96)
    linear = quant._dynamic_int8(layer)
    pieces = quant.Int8Linear(torch.cat(list(linear.pieces())), linear.scale, layer.bias.detach(), rows=32)
    assert len(pieces.parts) == 3
    x = (torch.randn(2, 40, 512) * 2).bfloat16()
    q, level, zero = quant.tensor_levels(x, quant.LOUD_ROWS)
    weight = torch.cat(list(linear.pieces())).double() * linear.scale.double()[:, None]
    exact = ((q.double() - zero) * level) @ weight.T + layer.bias.double()
    want = torch.nn.functional.gelu(exact, approximate="tanh") if gelu else exact
    for ours in (linear, pieces):
        y = ours.bf16_rows(x, gelu=gelu)
        assert y.dtype == torch.bfloat16 and y.shape == (2, 40, 96)
        assert torch.allclose(y.double(), want, rtol=2 ** -8, atol=1e-3 * want.abs().max().item())
    assert torch.equal(linear(x), linear.bf16_rows(x))  # forward's path for bf16 rows
    x[1, 3] *= 10  # a high-norm token
    y = linear(x.float())
    assert torch.equal(linear.bf16_rows(x, gelu=gelu),
                       (torch.nn.functional.gelu(y, approximate="tanh") if gelu else y).bfloat16())
    quant.use_kernel("fbgemm")
    fbgemm = quant._dynamic_int8(layer)
    y = fbgemm(x.float())
    assert torch.equal(fbgemm.bf16_rows(x, gelu=gelu),
                       (torch.nn.functional.gelu(y, approximate="tanh") if gelu else y).bfloat16())


@pytest.mark.parametrize("mode", ["w8a14", "int4"])
def test_an_int8_vision_tower_computes_in_bf16_around_onednns_kernel_and_is_no_farther_from_fp32_than_the_fp32_one(
        tiny_dir, tmp_path, onednn, mode):
    """--vision-dtype int8 on oneDNN: the tower's blocks compute in bf16 and every one of its linears reads its bf16
    input quantized at one scale (jit.tensor_levels, once per linear a tower's pass), its first MLP linear applying the
    gelu; the precision (the answer and feature caches' key) names it, and the logits for the standard request, fed
    fp32's answer, are no farther from fp32's than with the tower in fp32 around the same linears at a scale per
    token (39.29 against 39.30 dB for w8a14, 18.83 against 18.79 for int4, on an AMX Xeon)."""
    request = [Turn("user", bench.QUESTION, (bench.photo(),))]
    config = AutoConfig.from_pretrained(tiny_dir).vision_config

    def answer(*flags, tokens=None):
        engine = Engine(settings.parse(["--model", str(tiny_dir), "--no-cache", "--no-model-cache", "--cache-dir",
                                        str(tmp_path), "--kv-memory", "0", "--int8-kernel", "onednn", "--kv-dtype",
                                        "fp32", "--quant", mode, *flags], env={}))
        assert jit.warm(engine.settings.cache_dir)
        dtypes, levels, gelus = [], [], []
        visual = engine.model.model.visual
        visual.blocks[0].register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
        tensor_levels, bf16_rows = jit.tensor_levels, quant.Int8Linear.bf16_rows
        with mock.patch.object(jit, "tensor_levels",
                               lambda x, loud: levels.append(x.dtype) or tensor_levels(x, loud)), \
                mock.patch.object(quant.Int8Linear, "bf16_rows",
                                  lambda self, x, gelu=False: gelus.append(gelu) or bf16_rows(self, x, gelu)):
            logits, _, tokens = bench.forced_chat(engine, request, tokens, 12)
        linears = sum(isinstance(m, quant.Int8Linear) for m in visual.modules())
        engine.close()
        return logits, tokens, engine.precision, set(dtypes), levels, gelus, linears

    want, tokens, *_ = answer("--quant", "fp32")
    ours, _, precision, dtypes, levels, gelus, linears = answer("--vision-dtype", "int8", tokens=tokens)
    assert "the tower's linears on 8-bit activations" in precision and dtypes == {torch.bfloat16}
    assert linears == 4 * config.depth + 2 * (1 + len(config.deepstack_visual_indexes))
    assert levels == [torch.bfloat16] * linears and gelus.count(True) == config.depth
    theirs, _, precision, dtypes, levels, gelus, _ = answer("--vision-dtype", "fp32", tokens=tokens)
    assert "8-bit activations" not in precision and dtypes == {torch.float32} and levels == gelus == []
    near, far = bench.fidelity(ours, want)["sqnr_db"], bench.fidelity(theirs, want)["sqnr_db"]
    assert 60 > near >= far - 0.1, (near, far)


@pytest.mark.skipif(not lean.FUSES_BF16, reason="oneDNN computes bf16 linears only on CPUs with AVX-512 or AMX")
@pytest.mark.parametrize("flags", [["--quant", "w8a14", "--vision-dtype", "bf16"], ["--quant", "bf16"]])
def test_a_bf16_towers_gelu_is_applied_inside_its_first_linear_and_is_no_farther_from_fp32_than_after_it(
        tiny_dir, tmp_path, monkeypatch, flags):
    """In a tower that computes in bf16 each block's MLP applies its gelu as oneDNN writes the first linear's output
    (lean.linear_gelu, asserted to run once a block); the logits for the standard request, fed fp32's answer, are no
    farther from fp32's than with the gelu applied after the linear, and within a bf16 rounding of them."""
    request, calls, fused = [Turn("user", bench.QUESTION, (bench.photo(),))], [], lean.linear_gelu
    monkeypatch.setattr(lean, "linear_gelu", lambda *args: calls.append(args[0].dtype) or fused(*args))

    def answer(*flags, tokens=None):
        engine = Engine(settings.parse(["--model", str(tiny_dir), "--no-cache", "--no-model-cache", "--cache-dir",
                                        str(tmp_path), "--kv-memory", "0", *flags], env={}))
        logits, _, tokens = bench.forced_chat(engine, request, tokens, 12)
        engine.close()
        return logits, tokens

    want, tokens = answer("--quant", "fp32")
    assert calls == []
    ours, _ = answer(*flags, tokens=tokens)
    blocks = AutoConfig.from_pretrained(tiny_dir).vision_config.depth
    assert calls == [torch.bfloat16] * blocks
    monkeypatch.setattr(lean, "FUSES_BF16", False)  # the MLPs built from here on apply the gelu after the linear
    theirs, _ = answer(*flags, tokens=tokens)
    assert len(calls) == blocks
    near, far = bench.fidelity(ours, want)["sqnr_db"], bench.fidelity(theirs, want)["sqnr_db"]
    assert 60 > near >= far - 0.1 and bench.fidelity(ours, theirs)["sqnr_db"] > 30, (near, far)


def test_auto_keeps_keys_and_values_in_bf16_in_every_quantized_mode_and_fp32_in_fp32():
    assert [modes.kv("auto", mode) for mode in ("w8a14", "int8", "int4", "w8a16")] == ["bf16"] * 4
    assert [modes.kv(choice, mode) for choice in ("auto", "fp32", "bf16") for mode in ("fp32", "w8a14")] == [
        "fp32", "bf16", "fp32", "fp32", "bf16", "bf16"]
    assert {modes.kv(choice, "bf16") for choice in ("auto", "fp32", "bf16")} == {"bf16"}  # bf16 keeps its own
    assert "KV cache bf16" in modes.describe("w8a14", kv_dtype="bf16")
    assert "KV" not in modes.describe("w8a14") + modes.describe("bf16", kv_dtype="bf16")


@pytest.mark.parametrize("mode", ["w8a14", "int4"])
def test_a_bf16_kv_cache_keeps_a_conversation_in_half_the_memory_says_so_and_is_no_farther_from_fp32(
        tiny_dir, tmp_path, mode):
    """--kv-dtype auto is bf16 in a quantized mode: the conversation it keeps takes half the bytes of fp32's, the
    precision (the answer cache's key) names it, and the logits for the standard request, fed fp32's answer, are no
    farther from fp32's than with the cache in fp32."""
    request = [Turn("user", bench.QUESTION, (bench.photo(),))]

    def answer(*flags, tokens=None):
        engine = Engine(settings.parse(["--model", str(tiny_dir), "--no-cache", "--no-model-cache", "--cache-dir",
                                        str(tmp_path), *flags], env={}))
        logits, _, tokens = bench.forced_chat(engine, request, tokens, 12)
        (entry,) = engine.kv._entries.values()  # the conversation it keeps
        held = engine.memory_info()["conversations"]["bytes"]
        engine.close()
        return logits, tokens, engine.precision, held, entry.cache.layers[0].keys.dtype

    want, tokens, *_ = answer("--quant", "fp32")
    ours, _, precision, held, kept = answer("--quant", mode, tokens=tokens)
    assert "KV cache bf16" in precision and kept == torch.bfloat16
    theirs, _, precision, fp32_held, kept = answer("--quant", mode, "--kv-dtype", "fp32", tokens=tokens)
    assert "KV" not in precision and kept == torch.float32 and held * 2 == fp32_held > 0
    near, far = bench.fidelity(ours, want)["sqnr_db"], bench.fidelity(theirs, want)["sqnr_db"]
    assert 60 > near >= far - 0.1, (near, far)


def test_int8_weights_read_as_bf16_compute_the_bf16_linear_of_their_dequantized_weights():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 64)
    layer = quant.Int8WeightOnly.quantize(linear)
    layer.bias.data = layer.bias.data.bfloat16()
    x = torch.randn(300, 256).bfloat16()
    dequantized = layer.int8_weight.float() * layer.scale.float()[:, None]
    want = torch.nn.functional.linear(x.float(), dequantized, linear.bias.detach())
    y = layer(x)
    assert y.dtype == torch.bfloat16
    assert ((y.float() - want).norm() / want.norm()) < 0.01


def test_once_warm_the_numba_kernel_converts_int8_weights_to_bf16_bit_for_bit_as_torchs_ops(tmp_path, monkeypatch):
    """A bf16 tower's linears take their int8 weights times the rows' scales in one numba pass: the product of an int8
    and a bf16 is exact in float32, so the one rounding to bf16 is torch's, scales of every size and ties included."""
    assert jit.warm(str(tmp_path))
    torch.manual_seed(0)
    values = torch.randint(-128, 128, (512, 96), dtype=torch.int8)
    scale = (torch.randn(512) * torch.logspace(-12, 12, 512)).bfloat16()
    assert torch.equal(jit.dequantized(values, scale), values.to(torch.bfloat16).mul_(scale[:, None]))
    layer = quant.Int8WeightOnly.quantize(torch.nn.Linear(256, 64))
    layer.bias.data = layer.bias.data.bfloat16()  # as a bf16 tower holds it
    x, calls, ready = torch.randn(300, 256).bfloat16(), [], threading.Event()
    dequantized = jit.dequantized
    monkeypatch.setattr(jit, "dequantized", lambda *args: calls.append(1) or dequantized(*args))
    monkeypatch.setattr(jit, "ready", ready)
    plain = layer(x)
    ready.set()
    assert torch.equal(layer(x), plain) and calls == [1]
