"""taskrt.jit_cache: a module's numba cache goes when a file it depends on changes, and only then."""
import json
import os
import subprocess
import sys
import textwrap

import numba
import pytest
from numba.core import caching

from taskrt import jit_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write(path, text, bump=0):
    """Write a file; bump moves its time forward so that a same-sized edit is seen."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(textwrap.dedent(text))
    if bump:
        stat = os.stat(path)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + bump * 10**9))


def cache_files(folder, *modules):
    """Make index and data files named as numba names them for a function of each module."""
    os.makedirs(folder, exist_ok=True)
    for module in modules:
        for suffix in ("nbi", "1.nbc"):
            open(os.path.join(folder, f"{module}.kernel-3.py311.{suffix}"), "w").close()


def modules_of(dropped):
    return sorted({name.split(".")[0] for name in dropped})


@pytest.fixture
def tree(tmp_path):
    """A package: kern (numba) imports helper (numba) imports consts (plain) by three import
    forms; lone (numba) imports nothing; kern_extra shares a prefix with kern."""
    pkg = tmp_path / "pkg"
    write(str(pkg / "__init__.py"), "")
    write(str(pkg / "consts.py"), "SCALE = 2\n")
    write(str(pkg / "helper.py"), """\
        import numba
        from . import consts
        """)
    write(str(pkg / "kern.py"), """\
        from numba import njit
        from pkg.helper import numba
        def f():
            from .other import thing
        """)
    write(str(pkg / "other.py"), "thing = 1\n")
    write(str(pkg / "lone.py"), "import numba\n")
    write(str(pkg / "kern_extra.py"), "import numba\n")
    return str(pkg)


def test_the_first_refresh_drops_every_cache_then_nothing_until_a_file_changes(tree):
    folder = jit_cache.cache_folder(tree)
    cache_files(folder, "kern", "helper", "lone", "kern_extra")
    assert modules_of(jit_cache.refresh(tree)) == ["helper", "kern", "kern_extra", "lone"]
    cache_files(folder, "kern", "helper", "lone", "kern_extra")
    assert jit_cache.refresh(tree) == []
    assert len(os.listdir(folder)) == 9   # eight cache files and the state


def test_a_change_drops_the_modules_that_depend_on_it_through_numba_modules(tree):
    folder = jit_cache.cache_folder(tree)
    jit_cache.refresh(tree)
    cache_files(folder, "kern", "helper", "lone", "kern_extra")
    write(os.path.join(tree, "consts.py"), "SCALE = 3\n", bump=1)   # same size, later time
    assert modules_of(jit_cache.refresh(tree)) == ["helper", "kern"]
    cache_files(folder, "kern", "helper")
    write(os.path.join(tree, "other.py"), "thing = 22\n")
    assert modules_of(jit_cache.refresh(tree)) == ["kern"]
    cache_files(folder, "kern")
    write(os.path.join(tree, "lone.py"), "import numba\nX = 1\n")
    assert modules_of(jit_cache.refresh(tree)) == ["lone"]
    assert sorted(os.listdir(folder)) == sorted(
        [f"{m}.kernel-3.py311.{s}" for m in ("helper", "kern", "kern_extra") for s in ("nbi", "1.nbc")]
        + [jit_cache.STATE_NAME])


def test_a_time_without_a_change_drops_nothing_and_a_broken_state_drops_all(tree):
    folder = jit_cache.cache_folder(tree)
    jit_cache.refresh(tree)
    cache_files(folder, "kern", "helper")
    write(os.path.join(tree, "consts.py"), "SCALE = 2\n", bump=5)
    assert jit_cache.refresh(tree) == []
    with open(os.path.join(folder, jit_cache.STATE_NAME), "w") as f:
        f.write("{not json")
    assert modules_of(jit_cache.refresh(tree)) == ["helper", "kern"]


def test_a_dependency_gone_from_under_an_unchanged_importer_drops_the_importer(tree):
    folder = jit_cache.cache_folder(tree)
    jit_cache.refresh(tree)
    cache_files(folder, "kern", "helper")
    os.remove(os.path.join(tree, "other.py"))
    assert modules_of(jit_cache.refresh(tree)) == ["kern"]
    assert jit_cache.refresh(tree) == []


def test_packages_beside_the_project_are_not_its_files(tree):
    """Installed, the project's packages stand in site-packages beside numba and the rest: a scan
    that took them in read hundreds of their files at each import."""
    root = os.path.dirname(tree)
    write(os.path.join(root, "numba", "__init__.py"), "import numba.core\nfrom numba import core\n")
    write(os.path.join(root, "numba", "core.py"), "import numba\n")
    write(os.path.join(root, "ops", "__init__.py"), "import numba\n")
    write(os.path.join(tree, "lone.py"), "import numba\nimport ops\n")
    jit_cache.refresh(tree)
    with open(os.path.join(jit_cache.cache_folder(tree), jit_cache.STATE_NAME)) as f:
        files = json.load(f)["files"]
    assert sorted(files) == sorted(["ops/__init__.py"] + [f"pkg/{name}.py" for name in (
        "__init__", "consts", "helper", "kern", "other", "lone", "kern_extra")])


def test_a_module_that_does_not_parse_leaves_the_refresh_to_its_import(tree):
    write(os.path.join(tree, "helper.py"), "def broken(:\n")
    jit_cache.refresh(tree)


@pytest.mark.parametrize("user_dir", [None, "numba_user_cache"])
def test_the_folder_is_where_numba_keeps_the_cache(tree, tmp_path, monkeypatch, user_dir):
    source = os.path.join(tree, "lone.py")
    if user_dir:
        monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / user_dir))
        monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path / user_dir))
        locator = caching.UserProvidedCacheLocator(write, source)
    else:
        monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
        locator = caching.InTreeCacheLocator(write, source)
    assert jit_cache.cache_folder(tree) == locator.get_cache_path()


def test_a_cached_caller_sees_its_callees_edit(tmp_path):
    """The hazard itself: numba reloads caller's cache, made with the old callee, unless the
    refresh drops it."""
    pkg = tmp_path / "pkg"
    write(str(pkg / "__init__.py"), "")
    write(str(pkg / "callee.py"), """\
        import numba

        @numba.njit(cache=True)
        def value():
            return 1
        """)
    write(str(pkg / "caller.py"), """\
        import numba
        from pkg.callee import value

        @numba.njit(cache=True)
        def call():
            return value() * 10
        """)
    run = ("import sys; from taskrt import jit_cache; jit_cache.refresh(sys.argv[1]); "
           "from pkg.caller import call; print(call())")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    env.pop("NUMBA_CACHE_DIR", None)

    def answer():
        return subprocess.run([sys.executable, "-c", run, str(pkg)], env=env, capture_output=True,
                              text=True, check=True).stdout.strip()

    assert answer() == "10"
    assert any(name.startswith("caller.") for name in os.listdir(pkg / "__pycache__"))
    write(str(pkg / "callee.py"), """\
        import numba

        @numba.njit(cache=True)
        def value():
            return 2
        """, bump=1)
    assert answer() == "20"
