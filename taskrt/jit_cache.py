"""Numba's on-disk cache, made to notice changes in the files a kernel's callees come from.

numba keys a cached function by its own source file: a kernel that calls a kernel (or reads a
constant) of another module keeps the old callee compiled in until its own file changes, so an
edit to a shared kernel silently did not reach its callers. Each package calls `refresh` as it
is imported, before any of its kernels can load from the cache: it drops a module's cache files
when a project file the module depends on has changed since they were written.

A module depends on its own file, on each project module it imports, and, through every
imported module that uses numba, on what that one depends on (an imported plain module can
only give constants, read from that module itself). The project is PROJECT's packages and the
one refreshed, beside it: installed, that folder is site-packages, and numba, numpy and the
rest there are not the project's (taking them in read some 300 files at each import, 4.5 s
against 0.7, and 7 s at every import where the state could not be saved). Only numba's in-tree cache
(`__pycache__`) and `NUMBA_CACHE_DIR` are looked at. What was seen is kept in the cache folder
(`jit_deps.json`): each file's size, time and digest, and each module's digest of its
dependencies; only files whose size or time changed are read again.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import tempfile

STATE_NAME = "jit_deps.json"
_VERSION = 1
#: the project's top-level packages (setup.py's), whose files a module's dependencies are
#: looked for in
PROJECT = ("taskrt", "ops", "strategies", "apps", "tools")


def refresh(package: str) -> list[str]:
    """Drop the numba cache files of each module of `package` (its folder, or a file in it: a
    package's __init__.py calls refresh(__file__)) whose dependencies changed since the last
    refresh; return the dropped files' names. Never raises for the file system: a cache that
    cannot be read or written is left to numba."""
    package_dir = os.path.abspath(package)
    if os.path.isfile(package_dir):
        package_dir = os.path.dirname(package_dir)
    cache_dir = cache_folder(package_dir)
    state_path = os.path.join(cache_dir, STATE_NAME)
    state = _load(state_path)
    scan = _Scan(os.path.dirname(package_dir), state["files"], (*PROJECT, os.path.basename(package_dir)))
    digests = {name[:-3]: scan.closure_digest(os.path.join(package_dir, name))
               for name in sorted(os.listdir(package_dir)) if name.endswith(".py")}
    stale = [module for module, digest in digests.items() if state["modules"].get(module) != digest]
    dropped = _drop(cache_dir, stale)
    if stale or scan.changed or scan.files.keys() != state["files"].keys():
        _save(state_path, {"version": _VERSION, "files": scan.files, "modules": digests})
    return dropped


def cache_folder(package_dir: str) -> str:
    """Where numba keeps the cache of functions defined in package_dir's modules."""
    user_dir = os.environ.get("NUMBA_CACHE_DIR")
    if not user_dir:
        return os.path.join(package_dir, "__pycache__")
    hashed = hashlib.sha1(package_dir.encode()).hexdigest()
    return os.path.join(user_dir, f"{os.path.basename(package_dir)}_{hashed}")


class _Scan:
    """Files of the project under root (its top-level packages `packages`): their digests,
    imports and use of numba, by path relative to root, with the size and time they were read
    at. `files` holds those this scan met (read again where they changed since `known`, the
    last scan's), so files no module depends on any more are forgotten."""

    def __init__(self, root: str, known: dict, packages: tuple[str, ...]):
        self.root = root
        self.known = known
        self.packages = frozenset(packages)
        self.files: dict[str, dict] = {}
        self.changed = False

    def closure_digest(self, path: str) -> str:
        """One digest of the contents of every file path's module depends on."""
        digest = hashlib.sha256()
        for dep in sorted(self._closure(os.path.relpath(path, self.root))):
            digest.update(f"{dep}:{self._entry(dep)['digest']};".encode())
        return digest.hexdigest()

    def _closure(self, rel: str) -> set:
        """rel, its imports, and, through every imported module that uses numba, its imports."""
        deps, todo = {rel}, [rel]
        while todo:
            for imported in self._entry(todo.pop())["imports"]:
                if imported not in deps:
                    deps.add(imported)
                    if self._entry(imported)["numba"]:
                        todo.append(imported)
        return deps

    def _entry(self, rel: str) -> dict:
        entry = self.files.get(rel)
        if entry is not None:
            return entry
        path = os.path.join(self.root, rel)
        try:
            stat = os.stat(path)
            entry = self.known.get(rel)
            if entry is None or entry["size"] != stat.st_size or entry["mtime_ns"] != stat.st_mtime_ns:
                with open(path, "rb") as f:
                    source = f.read()
                imports, uses_numba = _imports(source, rel, self.root, self.packages)
                entry = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                         "digest": hashlib.sha256(source).hexdigest(), "imports": imports, "numba": uses_numba}
                self.changed = True
        except OSError:   # gone since a module that imports it was read: its import will say so
            entry = {"size": -1, "mtime_ns": -1, "digest": "", "imports": [], "numba": False}
            self.changed = True
        self.files[rel] = entry
        return entry


def _imports(source: bytes, rel: str, root: str, packages: frozenset) -> tuple[list[str], bool]:
    """The project files (of root's top-level `packages`) a module's source imports (paths
    relative to root), anywhere in it, and whether it imports numba."""
    package = os.path.dirname(rel).replace(os.sep, ".")
    found, uses_numba = set(), False
    try:
        tree = ast.parse(source, filename=rel)
    except (SyntaxError, ValueError):
        return [], False   # the module's own import will name the error
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
            uses_numba |= any(name.split(".")[0] == "numba" for name in names)
            for name in names:
                found.update(_module_files(name, (), root, packages))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(p for p in parts + [base] if p)
            uses_numba |= base.split(".")[0] == "numba"
            found.update(_module_files(base, [alias.name for alias in node.names], root, packages))
    found.discard(rel)
    return sorted(found), uses_numba


def _module_files(module: str, names, root: str, packages: frozenset) -> list[str]:
    """The files of root's `packages` that `from module import names` (or `import module`)
    reads: module's own file, or its package's __init__.py and any names that are submodules."""
    if not module or module.split(".")[0] not in packages:
        return []
    base = os.path.join(*module.split("."))
    if os.path.isfile(os.path.join(root, base + ".py")):
        return [base + ".py"]
    init = os.path.join(base, "__init__.py")
    if not os.path.isfile(os.path.join(root, init)):
        return []
    files = [init]
    for name in names:
        submodule = os.path.join(base, name + ".py")
        if os.path.isfile(os.path.join(root, submodule)):
            files.append(submodule)
    return files


def _drop(cache_dir: str, modules: list[str]) -> list[str]:
    """Remove numba's index and data files of the functions defined in these modules."""
    try:
        names = os.listdir(cache_dir)
    except OSError:
        return []
    prefixes = tuple(module + "." for module in modules)
    dropped = []
    for name in names:
        if name.startswith(prefixes) and name.endswith((".nbi", ".nbc")):
            try:
                os.remove(os.path.join(cache_dir, name))
                dropped.append(name)
            except OSError:
                continue
    return sorted(dropped)


def _load(path: str) -> dict:
    """The state the last refresh saved, or an empty one (none yet, unreadable, older)."""
    empty = {"version": _VERSION, "files": {}, "modules": {}}
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return empty
    return state if isinstance(state, dict) and state.get("version") == _VERSION else empty


def _save(path: str, state: dict) -> None:
    """Write the state whole or not at all (ranks of one job refresh at the same time)."""
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=STATE_NAME, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)
    except OSError:
        return
