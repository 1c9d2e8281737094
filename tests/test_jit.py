"""The numba decode kernels (qvl.engine.jit): compiled in the background once the engine serves, unless --no-jit, and
never a reason for an engine not to serve. That they compute what torch's ops compute is in test_lean and
test_quant (the kernels fixture)."""
import itertools
import json

import pytest
import torch

from qvl.engine import cpu, jit, vnni

ENGINE = """
import json, sys
from qvl import settings
from qvl.conversation import Turn
from qvl.engine import jit, lean, vnni
from qvl.engine.local import Engine
{prelude}
calls = []
attend = jit.attend
jit.attend = lambda *args: calls.append(1) or attend(*args)
linear, decode = vnni.linear, vnni.decode
vnni.linear = lambda *args: calls.append(2) or linear(*args)
vnni.decode = lambda *args: calls.append(3) or decode(*args)
engine = Engine(settings.parse(["--model", sys.argv[1], "--quant", "w8a14", "--no-cache", "--cache-dir", sys.argv[2],
                                *sys.argv[3:]], env={{}}))
assert engine.settled.wait(120)
calls.clear()  # what warming up called
# Sampled at a fixed seed: the tiny model answers greedily with one token over and over.
params = settings.GenParams(greedy=False, temperature=1.0, top_k=0, top_p=1.0, seed=3, max_new_tokens=6, min_new_tokens=6)
*pieces, stats = engine.chat([Turn("user", "Hello there")], params)
print(json.dumps({{"numba": "numba" in sys.modules, "ready": jit.ready.is_set(), "calls": calls.count(1),
                  "vnni": vnni.ready, "vnni_calls": calls.count(2), "vnni_decodes": calls.count(3), "onednn": "oneDNN" in engine.precision,
                  "answer": "".join(pieces), "layers": len(engine.model.model.language_model.layers)}}))
"""


def _serve(python_child, tiny_dir, tmp_path, *flags, prelude=""):
    child = python_child(ENGINE.format(prelude=prelude), tiny_dir, tmp_path / "cache", *flags)
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.splitlines()[-1]), child.stderr


@pytest.fixture(scope="module")
def served(python_child, tiny_dir, tmp_path_factory):
    """The same answer from engines in fresh processes: by default, with --no-jit, and where numba is missing."""
    out = {}
    for name, flags, prelude in (("default", (), ""), ("no-jit", ("--no-jit",), ""),
                                 ("no-numba", (), "sys.modules['numba'] = None  # as where no wheel installs")):
        out[name] = _serve(python_child, tiny_dir, tmp_path_factory.mktemp(name), *flags, prelude=prelude)
    return out


def test_an_engine_compiles_the_kernels_in_the_background_and_decodes_with_them(served):
    result, _ = served["default"]
    assert result["numba"] and result["ready"]
    steps = 5 * result["layers"]  # every decode step after the first token, every layer
    # Where the int8 linears are oneDNN's (auto on AMX), each decode step is one call of qvl's kernels (the layers'
    # attention and the head inside it); the prompt's last row reads the head's weights with qvl's kernel too.
    assert result["calls"] == (0 if result["vnni"] else steps)
    assert result["vnni_decodes"] == (5 if result["vnni"] else 0)
    assert result["vnni_calls"] == (1 if result["vnni"] else 0)  # the prompt's last row's head; steps' are inside
    assert result["vnni"] == (result["onednn"] and "AMX" in cpu.flags())


def test_no_jit_leaves_numba_unimported_and_decodes_with_torchs_ops_to_the_same_answer(served):
    result, _ = served["no-jit"]
    assert not result["numba"] and not result["ready"] and result["calls"] == 0 and not result["vnni"]
    assert result["answer"] == served["default"][0]["answer"] and len(set(result["answer"])) > 2


def test_without_numba_the_engine_says_so_once_and_serves_with_torchs_ops(served):
    result, log = served["no-numba"]
    assert not result["ready"] and result["calls"] == 0 and result["answer"] == served["default"][0]["answer"]
    assert log.count("the numba decode kernels are unavailable (ModuleNotFoundError") == 1


def test_where_numbas_target_lacks_avx512_vnni_vnnis_kernel_is_not_compiled_and_says_so(monkeypatch, caplog):
    """LLVM aborts the process on an intrinsic its target lacks, so the kernel asks numba's target (NUMBA_CPU_FEATURES
    names it where set), not the CPU; the decode rows then stay oneDNN's call (served["no-jit"]'s answer is theirs)."""
    import numba

    monkeypatch.setattr(numba.config, "CPU_FEATURES", "+avx2,+fma")
    monkeypatch.setattr(vnni, "ready", False)
    monkeypatch.setattr(vnni, "_decode", None)
    assert not vnni.warm() and not vnni.ready and vnni._decode is None
    assert "(ValueError: numba's target has no AVX-512 VNNI); oneDNN's own call decodes" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_attention_takes_rows_of_any_length_and_any_number_of_queries_per_key_head(engine, dtype):
    """head_dim 16 (the tiny model's) and 128 (the 2B's) fill whole lanes, 80 two 32-value stretches and 16 more, 40
    and 7 leave a tail; query heads go in pairs, so 1 and 3 per key head leave one to pair with itself: each is softmax
    attention over the first n cached positions, as computed in float64."""
    engine.settled.wait()
    assert jit.warm(engine.settings.cache_dir)
    generator = torch.Generator().manual_seed(0)
    for dim, group in itertools.product((16, 128, 80, 40, 7), (1, 2, 3)):
        q = torch.randn(3, group, dim, generator=generator)
        keys, values = (torch.randn(3, 50, dim, generator=generator).to(dtype) for _ in range(2))
        weights = (torch.einsum("hgd,hpd->hgp", q.double(), keys[:, :37].double()) * 0.3).softmax(-1)
        expected = torch.einsum("hgp,hpd->hgd", weights, values[:, :37].double())
        torch.testing.assert_close(jit.attend(q, keys, values, 37, 0.3).double(), expected, rtol=1e-5, atol=1e-5)
