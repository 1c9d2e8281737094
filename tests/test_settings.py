"""Configuration: one typed object from CLI flags, QVL_* env vars and defaults; CPU facts that pick defaults."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qvl import cpu, kv, settings

ROOT = Path(__file__).resolve().parent.parent


def test_flag_beats_env_beats_default():
    s = settings.parse(["--threads", "1"], env={"QVL_THREADS": "3", "QVL_MAX_NEW_TOKENS": "50"})
    assert s.threads == 1 and s.gen.max_new_tokens == 50 and s.gen.top_k == 20


def test_every_setting_has_a_flag_and_an_env_var():
    flags = settings.parse([], env={"QVL_GREEDY": "yes", "QVL_CACHE": "0", "QVL_AUTH": "ann:secret"})
    assert flags.gen.greedy and not flags.cache and flags.auth == "ann:secret"
    assert settings.parse(["--no-cache", "--greedy", "--share"], env={}).share


def test_bind_is_localhost_unless_spaces_sets_it():
    assert settings.parse([], env={}).host == "127.0.0.1"


def test_spaces_server_name_and_port_are_honoured(monkeypatch):
    monkeypatch.setenv("GRADIO_SERVER_NAME", "0.0.0.0")
    monkeypatch.setenv("GRADIO_SERVER_PORT", "7861")
    s = settings.parse([], env={})
    assert (s.host, s.port) == ("0.0.0.0", 7861)
    assert settings.parse(["--host", "127.0.0.1"], env={}).host == "127.0.0.1"


def test_qwen_instruct_sampling_defaults():
    g = settings.GenParams()
    assert (g.temperature, g.top_p, g.top_k, g.greedy) == (0.7, 0.8, 20, False)
    assert 100 <= g.max_new_tokens <= 512


@pytest.mark.parametrize(
    "argv, env, named",
    [(["--quant", "fp16"], {}, "--quant"), ([], {"QVL_THREADS": "many"}, "QVL_THREADS"),
     ([], {"QVL_GREEDY": "maybe"}, "QVL_GREEDY"), (["--port", "http"], {}, "--port"),
     (["--max-sessions", "0"], {}, "--max-sessions"), ([], {"QVL_UPLOAD_HOURS": "-1"}, "--upload-hours"),
     (["--kv-memory", "lots"], {}, "--kv-memory"), ([], {"QVL_FEATURE_CACHE_SIZE": "-1"}, "--feature-cache-size")],
)
def test_bad_values_are_refused_with_the_name_of_the_setting(argv, env, named, capsys):
    with pytest.raises(SystemExit):
        settings.parse(argv, env=env)
    assert named in capsys.readouterr().err


def test_default_threads_follow_the_cgroup_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cpu.available_cores(tmp_path) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu.available_cores(tmp_path) == cpu.available_cores(tmp_path / "none")
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert cpu.available_cores(v1) == 1


def run_app(*flags: str):
    """`python app.py FLAGS` with Python's import log: (exit code, stdout, the modules it imported)."""
    done = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "app.py"), *flags], capture_output=True,
                          text=True, timeout=60, env={k: v for k, v in os.environ.items() if not k.startswith("QVL_")})
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time")}
    return done.returncode, done.stdout, done.stderr, imported


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_flag_with_its_default_without_loading_torch_or_gradio(flag):
    code, out, _, imported = run_app(flag)
    assert code == 0
    for name in [n for n, _, _ in settings._flags(settings.Settings())]:
        assert "--" + name.replace("_", "-") in out and "QVL_" + name.upper() in out
    words = " ".join(out.split())  # argparse wraps the help text
    assert "5% of the free disk" in words and "[env QVL_MAX_SESSIONS, default 1000]" in words
    assert not {"torch", "gradio", "transformers"} & imported  # parsed first: answered in a fraction of a second


def test_a_bad_flag_is_refused_before_torch_or_gradio_load():
    code, _, err, imported = run_app("--quant", "fp16")
    assert code == 2 and "--quant must be one of auto, fp32, bf16, int8, int4, w8a16, w8a14 (got 'fp16')" in err
    assert not {"torch", "gradio", "transformers"} & imported


def test_several_auth_users_and_admins_and_priority_users_among_them(capsys):
    s = settings.parse(["--auth", "ann:pw:with:colons,bob:pw2", "--admins", "bob", "--priority-users", "ann, bob"],
                       env={})
    assert settings.credentials(s.auth) == [("ann", "pw:with:colons"), ("bob", "pw2")] and s.admin_names == ["bob"]
    assert s.priority_names == ["ann", "bob"]
    for flag in ("--admins", "--priority-users"):
        with pytest.raises(SystemExit):
            settings.parse(["--auth", "ann:pw", flag, "eve"], env={})  # not an --auth user
        assert f"{flag} names eve, not among the --auth users (ann)" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            settings.parse([flag, "ann"], env={})  # no --auth: nobody could prove they are ann
    with pytest.raises(SystemExit):
        settings.parse(["--auth", "ann"], env={})


def test_mcp_is_refused_with_auth_since_gradios_mcp_endpoint_has_no_login(capsys):
    assert settings.parse(["--mcp"], env={}).mcp
    with pytest.raises(SystemExit):
        settings.parse(["--mcp"], env={"QVL_AUTH": "ann:pw"})
    assert "--mcp cannot be combined with --auth" in capsys.readouterr().err


def test_only_a_localhost_server_without_share_is_private():
    assert settings.parse([], env={}).private
    assert not settings.parse(["--share"], env={}).private
    assert not settings.parse(["--host", "0.0.0.0"], env={}).private


def test_conversation_memory_is_sized_like_the_caches_and_auto_follows_the_ram(tmp_path):
    s = settings.parse(["--kv-memory", "1.5GB"], env={"QVL_FEATURE_CACHE_SIZE": "0"})
    assert kv.parse_limit(s.kv_memory) == 3 << 29 and s.feature_cache_size == "0"
    assert settings.parse([], env={}).kv_memory == "auto"
    (tmp_path / "memory.max").write_text(f"{8 << 30}\n")
    assert kv.auto_limit(str(tmp_path / "memory.max")) == 1 << 30  # an eighth of a container's 8 GiB
    (tmp_path / "memory.max").write_text("max\n")
    assert 0 < kv.auto_limit(str(tmp_path / "memory.max")) <= 4 << 30


def _cpuinfo(vendor: str, family: int, model: int, name: str) -> str:
    return (f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
            f"model name\t: {name}\nflags\t\t: fpu sse2 avx2 fma\n\nprocessor\t: 1\nvendor_id\t: {vendor}\n")


@pytest.mark.parametrize("vendor, family, model, name, core", [
    ("AuthenticAMD", 23, 1, "AMD EPYC", "Zen 1"),  # what this project's dev VMs report for a Naples host
    ("AuthenticAMD", 23, 49, "AMD EPYC 7B12", "Zen 2"),
    ("AuthenticAMD", 25, 1, "AMD EPYC", "Zen 3"),  # the same masked name, three times the int8 prefill
    ("AuthenticAMD", 25, 17, "AMD EPYC 9R14", "Zen 4"),
    ("AuthenticAMD", 26, 2, "AMD EPYC", "Zen 5"),
    ("AuthenticAMD", 27, 0, "AMD EPYC", "family 27 model 0"),
    ("GenuineIntel", 6, 143, "Intel(R) Xeon(R) Platinum 8480+", ""),
])
def test_an_amd_cpu_is_named_by_its_core_generation_which_its_model_name_may_hide(vendor, family, model, name, core):
    text = _cpuinfo(vendor, family, model, name)
    assert (cpu.core(text), cpu.model_name(text), cpu.flags(text)) == (core, name, frozenset({"AVX2"}))


@pytest.mark.parametrize("vendor, family, model, halves", [
    ("AuthenticAMD", 23, 1, True),  # Zen 1
    ("AuthenticAMD", 23, 8, True),  # Zen+
    ("AuthenticAMD", 21, 101, True),  # Excavator
    ("HygonGenuine", 24, 0, True),  # Hygon's Zen 1
    ("AuthenticAMD", 23, 49, False),  # Zen 2
    ("AuthenticAMD", 25, 1, False),  # Zen 3
    ("AuthenticAMD", 26, 2, False),  # Zen 5
    ("GenuineIntel", 6, 190, True),  # Alder Lake-N (N100): Gracemont cores only
    ("GenuineIntel", 6, 143, False),  # Sapphire Rapids
    ("GenuineIntel", 6, 63, False),  # Haswell
])
def test_cores_that_split_256_bit_operations_in_two_are_known(vendor, family, model, halves):
    assert cpu.halves_256_bit(_cpuinfo(vendor, family, model, "a CPU")) is halves


def test_cores_of_a_cpu_without_family_and_model_are_taken_as_whole():
    assert cpu.halves_256_bit("") is False and cpu.halves_256_bit("vendor_id\t: AuthenticAMD\n") is False


def test_the_start_up_line_and_the_benchmarks_name_the_core_generation(monkeypatch):
    monkeypatch.setattr(cpu, "_cpuinfo", lambda: _cpuinfo("AuthenticAMD", 23, 1, "AMD EPYC"))
    assert cpu.describe().startswith("AMD EPYC (Zen 1), ") and cpu.describe().endswith(" cores, AVX2")
    monkeypatch.setattr(cpu, "_cpuinfo", lambda: _cpuinfo("GenuineIntel", 6, 143, "Intel(R) Xeon(R) Platinum 8480+"))
    assert cpu.describe().startswith("Intel(R) Xeon(R) Platinum 8480+, ")
