"""`pip install .` makes kvwire importable anywhere, and vLLM finds its connector by name.

Run by `make test-vllm` (KVWIRE_VLLM_VENV: the venv scripts/vllm-venv.sh made, where kvwire
was installed with `pip install .`). Every command runs with no PYTHONPATH, from a folder
outside the checkout.
"""
import os
import subprocess
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def clean_env():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["HF_HUB_OFFLINE"] = "1"
    return env


def run(cmd, cwd, timeout=1200):
    r = subprocess.run(cmd, cwd=cwd, env=clean_env(), capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"{cmd} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r.stdout


def test_pip_install_in_a_fresh_venv_imports_from_anywhere():
    with tempfile.TemporaryDirectory() as tmp:
        venv = os.path.join(tmp, "venv")
        run(["/usr/bin/python3", "-m", "venv", venv], tmp)
        py = os.path.join(venv, "bin", "python")
        run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c",
             os.path.join(ROOT, "constraints.txt"), ROOT], tmp)
        elsewhere = os.path.join(tmp, "elsewhere")
        os.mkdir(elsewhere)
        out = run([py, "-c", textwrap.dedent("""
            import kvwire, _kvwire
            b = kvwire.Buffer(4096)
            print(kvwire.__file__)
            print(_kvwire.__file__)
            print(len(b))
        """)], elsewhere)
        lines = out.split()
        assert lines[0].startswith(venv) and lines[1].startswith(venv), lines
        assert lines[2] == "4096"


def test_vllm_finds_the_connector_by_name_through_the_entry_point():
    venv = os.environ.get("KVWIRE_VLLM_VENV")
    assert venv, "KVWIRE_VLLM_VENV is not set (run through make test-vllm)"
    with tempfile.TemporaryDirectory() as tmp:
        out = run([os.path.join(venv, "bin", "python"), "-c", textwrap.dedent("""
            from vllm.config import KVTransferConfig
            from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
            from vllm.plugins import load_general_plugins
            load_general_plugins()  # what every vLLM process does before making a connector
            cls = KVConnectorFactory.get_connector_class(
                KVTransferConfig(kv_connector="KvwireConnector", kv_role="kv_both"))
            import sys
            print(cls.__module__, cls.__name__, sys.modules[cls.__module__].__file__)
        """)], tmp)
        module, name, path = out.split()[-3:]
        assert (module, name) == ("kvwire.vllm_connector", "KvwireConnector")
        assert path.startswith(venv), path  # the installed package, not the checkout


if __name__ == "__main__":
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-v", __file__]))
