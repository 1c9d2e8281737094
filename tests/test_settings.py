"""Configuration: one typed object from CLI flags, QVL_* env vars and defaults; CPU facts that pick defaults."""
import os
import subprocess
import sys
from pathlib import Path

from types import SimpleNamespace

import gradio as gr
import pytest

import qvl
from qvl import settings, texts
from qvl.engine import cpu, kv
from qvl.serve import answers, settings_tab

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


def test_spaces_server_name_and_port_are_honoured():
    spaces = {"GRADIO_SERVER_NAME": "0.0.0.0", "GRADIO_SERVER_PORT": "7861"}
    s = settings.parse([], env=spaces)
    assert (s.host, s.port) == ("0.0.0.0", 7861)
    assert settings.parse(["--host", "127.0.0.1"], env=spaces).host == "127.0.0.1"
    assert settings.parse([], env={**spaces, "QVL_PORT": "8000"}).port == 8000


def test_qwen_instruct_sampling_defaults():
    g = settings.GenParams()
    assert (g.temperature, g.top_p, g.top_k, g.greedy) == (0.7, 0.8, 20, False)
    assert 100 <= g.max_new_tokens <= 512


# One bad value for every flag of --help: (command line, environment, the refusal's last line). A switch takes no
# value on the command line (--greedy=maybe is argparse's own error), so its bad value is its variable's.
BAD = {
    "--model": (["--model", "/nonexistent"], {}, "argument --model: folder /nonexistent does not exist"),
    "--require-model": ([], {"QVL_REQUIRE_MODEL": "sure"},
                        "QVL_REQUIRE_MODEL: sure is not one of 1, true, yes, on, 0, false, no, off"),
    "--quant": (["--quant", "fp16"], {}, "argument --quant: fp16 is not one of auto, fp32, bf16, int8, int4, w8a16, "
                                         "w8a14"),
    "--threads": (["--threads", "0"], {}, "argument --threads: 0 is not a whole number of at least 1"),
    "--interop-threads": (["--interop-threads", "0"], {},
                          "argument --interop-threads: 0 is not a whole number of at least 1"),
    "--max-context": (["--max-context", "10"], {}, "argument --max-context: 10 is not a whole number of at least 64"),
    "--max-new-tokens": (["--max-new-tokens", "0"], {},
                         "argument --max-new-tokens: 0 is not a whole number of at least 1"),
    "--temperature": (["--temperature", "-1"], {}, "argument --temperature: -1 is not a number from 0.05 to 2.0"),
    "--top-p": (["--top-p", "2"], {}, "argument --top-p: 2 is not a number from 0.05 to 1.0"),
    "--top-k": (["--top-k", "0"], {}, "argument --top-k: 0 is not a whole number from 1 to 200"),
    "--greedy": ([], {"QVL_GREEDY": "maybe"}, "QVL_GREEDY: maybe is not one of 1, true, yes, on, 0, false, no, off"),
    "--seed": (["--seed", "-1"], {}, "argument --seed: -1 is not a whole number from 0 to 4294967295"),
    "--max-image-tokens": (["--max-image-tokens", "0"], {},
                           "argument --max-image-tokens: 0 is not a whole number from 16 to 16384"),
    "--min-image-tokens": (["--min-image-tokens", "0"], {},
                           "argument --min-image-tokens: 0 is not a whole number from 16 to 16384"),
    "--min-new-tokens": (["--min-new-tokens", "-1"], {},
                         "argument --min-new-tokens: -1 is not a whole number of at least 0"),
    "--max-pdf-pages": (["--max-pdf-pages", "0"], {}, "argument --max-pdf-pages: 0 is not a whole number of at least 1"),
    "--max-video-frames": ([], {"QVL_MAX_VIDEO_FRAMES": "1000"},
                           "QVL_MAX_VIDEO_FRAMES: 1000 is not a whole number from 2 to 768"),
    "--host": (["--host", "http://0.0.0.0"], {},
               "argument --host: http://0.0.0.0 is not an address such as 127.0.0.1 or 0.0.0.0, nor a host name"),
    "--port": (["--port", "70000"], {}, "argument --port: 70000 is not a whole number from 1 to 65535"),
    "--share": ([], {"QVL_SHARE": "always"}, "QVL_SHARE: always is not one of 1, true, yes, on, 0, false, no, off"),
    # The value holds passwords: the refusal never repeats it.
    "--auth": (["--auth", "ann;hunter2"], {}, "argument --auth: the value (not shown: it holds passwords) is not "
                                              "user:password, several separated by commas"),
    "--admins": (["--auth", "ann:pw", "--admins", "eve"], {}, "--admins names eve, not among the --auth users (ann)"),
    "--priority-users": (["--auth", "ann:pw", "--priority-users", "eve"], {},
                         "--priority-users names eve, not among the --auth users (ann)"),
    "--cache": ([], {"QVL_CACHE": "2"}, "QVL_CACHE: 2 is not one of 1, true, yes, on, 0, false, no, off"),
    "--cache-dir": (["--cache-dir", str(ROOT / "app.py")], {}, f"argument --cache-dir: {ROOT / 'app.py'} is a file, "
                                                               "not a folder"),
    "--cache-size": (["--cache-size", "lots"], {},
                     "argument --cache-size: lots is not auto, 0 or a size such as 500MB or 2GB"),
    "--model-cache": ([], {"QVL_MODEL_CACHE": "2"},
                      "QVL_MODEL_CACHE: 2 is not one of 1, true, yes, on, 0, false, no, off"),
    "--int8-kernel": (["--int8-kernel", "mkl"], {}, "argument --int8-kernel: mkl is not one of auto, fbgemm, onednn"),
    "--vision-dtype": ([], {"QVL_VISION_DTYPE": "fp16"}, "QVL_VISION_DTYPE: fp16 is not one of auto, fp32, bf16, int8"),
    "--kv-dtype": (["--kv-dtype", "int8"], {}, "argument --kv-dtype: int8 is not one of auto, fp32, bf16"),
    "--jit": ([], {"QVL_JIT": "numba"}, "QVL_JIT: numba is not one of 1, true, yes, on, 0, false, no, off"),
    "--model-cache-dir": (["--model-cache-dir", str(ROOT / "app.py")], {},
                          f"argument --model-cache-dir: {ROOT / 'app.py'} is a file, not a folder"),
    "--kv-memory": (["--kv-memory", "-1"], {},
                    "argument --kv-memory: -1 is not auto, 0 or a size such as 500MB or 2GB"),
    "--feature-cache-size": (["--feature-cache-size", "1 gigabyte"], {},
                             "argument --feature-cache-size: 1 gigabyte is not auto, 0 or a size such as 500MB or 2GB"),
    "--queue-size": (["--queue-size", "0"], {}, "argument --queue-size: 0 is not a whole number of at least 1"),
    "--max-file-size": (["--max-file-size", "0"], {}, "argument --max-file-size: 0 is not a size above 0 such as 20mb"),
    "--max-sessions": (["--max-sessions", "0"], {}, "argument --max-sessions: 0 is not a whole number of at least 1"),
    "--upload-hours": (["--upload-hours", "-1"], {}, "argument --upload-hours: -1 is not a number of at least 0"),
    "--allow-image-urls": ([], {"QVL_ALLOW_IMAGE_URLS": "all"},
                           "QVL_ALLOW_IMAGE_URLS: all is not one of 1, true, yes, on, 0, false, no, off"),
    "--backend": (["--backend", "127.0.0.1:8000/v1"], {},
                  "argument --backend: 127.0.0.1:8000/v1 is not an http(s) URL such as http://127.0.0.1:8000/v1"),
    "--backend-timeout": (["--backend-timeout", "0"], {},
                          "argument --backend-timeout: 0 is not a number of at least 1"),
    "--concurrency": (["--concurrency", "0"], {}, "argument --concurrency: 0 is not a whole number of at least 1"),
    "--batch": (["--batch", "9"], {}, "argument --batch: 9 is not a whole number from 1 to 8"),
    "--mcp": ([], {"QVL_MCP": "y"}, "QVL_MCP: y is not one of 1, true, yes, on, 0, false, no, off"),
}
# Flags with no bad value, and why.
NO_BAD_VALUE = {
    "--help": "takes no value",
    "--version": "takes no value",
    "--api-key": "any text can be a key",
    "--backend-model": "any name: the backend's own list decides, and it refuses an unknown one when asked",
    "--backend-key": "any text can be a key: the backend decides",
}


def test_every_flag_of_help_has_a_bad_value_or_a_reason_for_none():
    flags = {action.option_strings[-1 if action.option_strings[0] == "-h" else 0]
             for action in settings.build_parser({})._actions}
    assert flags == set(BAD) | set(NO_BAD_VALUE) and not set(BAD) & set(NO_BAD_VALUE)


@pytest.mark.parametrize("flag", BAD)
def test_a_bad_value_is_a_one_line_usage_error_naming_the_setting_the_value_and_what_it_takes(flag, capsys):
    argv, env, refusal = BAD[flag]
    with pytest.raises(SystemExit) as stop:
        settings.parse(argv, env=env)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.splitlines() == ["usage: app.py [options]", f"app.py: error: {refusal}"]
    assert "hunter2" not in err


@pytest.mark.parametrize("env, refusal", [
    ({"QVL_TOP_P": "2"}, "QVL_TOP_P: 2 is not a number from 0.05 to 1.0"),
    ({"QVL_CACHE_SIZE": "lots"}, "QVL_CACHE_SIZE: lots is not auto, 0 or a size such as 500MB or 2GB"),
    ({"GRADIO_SERVER_PORT": "http"}, "GRADIO_SERVER_PORT: http is not a whole number from 1 to 65535"),
    ({"GRADIO_SERVER_NAME": "0.0.0.0:7860"}, "GRADIO_SERVER_NAME: 0.0.0.0:7860 is not an address"),
    ({"QVL_AUTH": "ann"}, "QVL_AUTH: the value (not shown: it holds passwords) is not user:password"),
])
def test_a_bad_variable_is_refused_by_its_own_name(env, refusal, capsys):
    with pytest.raises(SystemExit) as stop:
        settings.parse([], env=env)
    assert stop.value.code == 2 and refusal in capsys.readouterr().err


@pytest.mark.parametrize("value", ["~/no-such-qvl-model", "./no-such-model", "../no-such-model", "models/qwen/2b"])
def test_a_model_path_that_does_not_exist_is_refused_and_a_hub_id_is_not(value, capsys):
    with pytest.raises(SystemExit):
        settings.parse(["--model", value], env={})
    assert f"argument --model: folder {value} does not exist" in capsys.readouterr().err
    for hub_id in ("Qwen/Qwen3-VL-8B-Instruct", "my-org/qwen3-vl.ft_2"):
        assert settings.parse(["--model", hub_id], env={}).model == hub_id
    with pytest.raises(SystemExit):
        settings.parse(["--model", "a model"], env={})
    assert "a model is neither a folder nor a hub id" in capsys.readouterr().err


def test_a_model_folder_is_taken_with_its_home_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "qwen").mkdir()
    assert settings.parse(["--model", "~/qwen"], env={}).model == str(tmp_path / "qwen")
    assert settings.parse([], env={"QVL_MODEL": "~/qwen"}).model == str(tmp_path / "qwen")


@pytest.mark.parametrize("name", ["max_image_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "seed",
                                  "max_video_frames"])
def test_the_page_takes_back_every_value_the_server_starts_with(name):
    """The settings tab's control sends its value back with every question, and Gradio refuses one outside the
    control's range: a start-up value it would refuse broke every question."""
    low, high = settings.BOUNDS[name]
    for value in (low, high or 100_000):
        config = settings.parse(["--" + name.replace("_", "-"), str(value)], env={})
        with gr.Blocks():
            parts = settings_tab.draw(gr.I18n(**texts.TEXT), SimpleNamespace(threads=1), SimpleNamespace(
                enabled=True), config)
        control = parts["controls"][name]
        assert control.preprocess(control.value) == value


@pytest.mark.parametrize("flags, refusal", [
    (["--max-image-tokens", "0"], "argument --max-image-tokens: 0 is not a whole number from 16 to 16384"),
    (["--temperature", "-1"], "argument --temperature: -1 is not a number from 0.05 to 2.0"),
    (["--cache-size", "lots"], "argument --cache-size: lots is not auto, 0 or a size such as 500MB or 2GB"),
    (["--model", "/nonexistent", "--require-model"], "argument --model: folder /nonexistent does not exist"),
])
def test_the_app_refuses_a_bad_flag_with_exit_code_2_and_no_traceback(flags, refusal):
    code, _, err, _ = run_app(*flags)
    assert code == 2 and refusal in err and "Traceback" not in err


def test_a_bad_spaces_port_is_a_usage_error_not_a_traceback():
    code, _, err, _ = run_app(GRADIO_SERVER_PORT="http")
    assert code == 2 and "GRADIO_SERVER_PORT: http is not a whole number from 1 to 65535" in err
    assert "Traceback" not in err


def test_version_prints_the_one_version_string():
    code, out, _, imported = run_app("--version")
    assert code == 0 and out == f"qvl {qvl.__version__}\n" and not {"torch", "gradio", "diskcache", "PIL"} & imported


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


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_a_thread_hands_its_openmp_workers_back_and_gets_them_again_when_it_computes():
    import threading
    import torch
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: OpenMP makes no workers")
    from test_batch import native_workers
    seen, x = [], torch.ones(1000, 1000)

    def compute():
        seen.append(native_workers())
        x.mul(2)  # parallel: this thread's team of workers
        seen.append(native_workers())
        cpu.release_threads()
        seen.append(native_workers())
        assert torch.equal(x.mul(2), torch.full((1000, 1000), 2.0))
        seen.append(native_workers())
        cpu.release_threads()

    thread = threading.Thread(target=compute)
    thread.start()
    thread.join()
    alone, working, released, again = seen
    team = working - alone
    assert team and not team & released and again - released


def run_app(*flags: str, **env: str):
    """`python app.py FLAGS` with Python's import log, in the environment without QVL_* and GRADIO_* variables but
    with env: (exit code, stdout, stderr, the modules it imported)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("QVL_", "GRADIO_"))}
    done = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "app.py"), *flags], capture_output=True,
                          text=True, timeout=60, env={**clean, **env})
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
    assert code == 2 and "argument --quant: fp16 is not one of auto, fp32, bf16, int8, int4, w8a16, w8a14" in err
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
