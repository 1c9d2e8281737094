"""The README's front matter configures the Hugging Face Space: only keys Spaces knows, the same Gradio and Python
the app is installed and tested with, and the app's own model preloaded."""
import re
import sys
from pathlib import Path

from qvl import settings

ROOT = Path(__file__).resolve().parent.parent
# Every key https://huggingface.co/docs/hub/spaces-config-reference lists (hub-docs, August 2026).
SPACES_KEYS = {"title", "emoji", "colorFrom", "colorTo", "sdk", "python_version", "sdk_version", "suggested_hardware",
               "suggested_storage", "app_file", "app_build_command", "app_port", "base_path", "fullWidth", "header",
               "short_description", "models", "datasets", "tags", "thumbnail", "pinned", "hf_oauth", "hf_oauth_scopes",
               "hf_oauth_expiration_minutes", "hf_oauth_authorized_org", "disable_embedding",
               "startup_duration_timeout", "custom_headers", "preload_from_hub"}


def front_matter() -> dict:
    """The YAML block between the README's first two `---` lines: `key: value` and `key:` with `  - item` lists."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[0] == "---"
    meta, key = {}, None
    for line in lines[1:lines.index("---", 1)]:
        if line.startswith("  - "):
            meta[key].append(line[4:].strip())
        else:
            key, _, value = line.partition(":")
            meta[key] = value.strip().strip('"') or []
    return meta


def pin(package: str) -> str:
    """The version requirements.txt pins package to, extras or not (gradio[mcp]==6.31.0)."""
    [line] = [line for line in (ROOT / "requirements.txt").read_text().splitlines()
              if re.match(rf"{re.escape(package)}(\[[^\]]*\])?==", line)]
    return line.split("==")[1]


def test_the_front_matter_uses_only_keys_spaces_knows():
    assert set(front_matter()) <= SPACES_KEYS


def test_the_space_runs_the_pinned_gradio_on_the_tested_python():
    meta = front_matter()
    assert meta["sdk"] == "gradio" and meta["sdk_version"] == pin("gradio")
    # .ci/run's venv is the interpreter running this test
    assert meta["python_version"] == f"{sys.version_info.major}.{sys.version_info.minor}"


def test_the_space_starts_app_py_on_cpu_basic_with_the_default_model_preloaded():
    meta = front_matter()
    assert (ROOT / meta["app_file"]).is_file() and meta["app_file"] == "app.py"
    assert meta["suggested_hardware"] == "cpu-basic"
    assert meta["models"] == meta["preload_from_hub"] == [settings.DEFAULT_MODEL]
