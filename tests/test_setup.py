"""setup.py: an install carries every file the packages read, and what they import."""
import ast
import json
import os
import re
import subprocess
import sys
from fnmatch import fnmatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("taskrt", "ops", "strategies", "apps", "tools")


def _distribution():
    """setup.py's arguments, read by setuptools without building anything."""
    out = subprocess.run([sys.executable, "-c", (
        "import json, setuptools\n"
        "seen = {}\n"
        "setuptools.setup = lambda **kw: seen.update(kw)\n"
        "exec(open('setup.py').read())\n"
        "print(json.dumps({k: seen[k] for k in ('packages', 'package_data', 'install_requires', "
        "'extras_require')}))")],
        cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_every_data_file_in_the_packages_is_installed():
    """A plain `pip install .` left strategies/machines/*.json out, so every --machine NAME failed."""
    dist = _distribution()
    missing = []
    for package in dist["packages"]:
        folder = os.path.join(ROOT, *package.split("."))
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if os.path.isdir(path) and name != "__pycache__" and not os.path.isfile(os.path.join(path, "__init__.py")):
                for data in os.listdir(path):   # a data folder (not a package) beside the modules
                    rel = f"{name}/{data}"
                    if not any(fnmatch(rel, pattern) for pattern in dist["package_data"].get(package, ())):
                        missing.append(f"{package}: {rel}")
    assert not missing


#: modules the packages import that come with another requirement (llvmlite with numba) or
#: with the `gpu` extra (imported only where a GPU is asked for)
COMES_WITH = {"llvmlite": "numba", "cupy": "cupy-cuda12x", "cupyx": "cupy-cuda12x", "cupy_backends": "cupy-cuda12x"}


def _imported_modules() -> set[str]:
    """The top-level modules the packages' files import, but the standard library's and their own."""
    names = set()
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(folder, name)) as f:
                        tree = ast.parse(f.read())
                    for node in ast.walk(tree):
                        if isinstance(node, ast.Import):
                            names.update(alias.name.split(".")[0] for alias in node.names)
                        elif isinstance(node, ast.ImportFrom) and node.level == 0:
                            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - set(PACKAGES)


def test_what_the_packages_import_is_installed_with_them():
    """The demo draws its pictures with matplotlib, which was a test extra: a plain install ran
    the demo's work and then failed on the import."""
    dist = _distribution()
    declared = {re.split(r"[<>=!~ ]", r)[0] for r in dist["install_requires"]}
    declared |= {re.split(r"[<>=!~ ]", r)[0] for r in dist["extras_require"]["gpu"]}
    assert {COMES_WITH.get(name, name) for name in _imported_modules()} <= declared


def test_mpi4py_is_new_enough_for_the_native_transport():
    """taskrt/mpi_native.py hands Comm.handle to MPI's C calls: an attribute mpi4py has from 4.0
    (with 3.1.4, the old lower bound, every run on many ranks failed)."""
    with open(os.path.join(ROOT, "taskrt", "mpi_native.py")) as f:
        assert ".handle" in f.read()
    assert "mpi4py>=4.0" in _distribution()["install_requires"]
