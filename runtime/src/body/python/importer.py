# Serves a package embedded in the binary (`#[py_op(package = ...)]`) from memory. pyop runs
# this once, in a namespace of its own, under the file name `<pyop>` (its frames are left out
# of tracebacks); `body/package.rs` calls `_install_package`.

import importlib.abc as _abc
import importlib.machinery as _machinery
import importlib.util as _util
import sys as _sys
import types as _types
from typing import Iterable, Mapping, Optional, Sequence, Union, cast

# A package's files, by their paths relative to its root (with "/"): a dict (`package.rs`) or
# (path, text) pairs (a worker's load request).
_Files = Union[Mapping[str, str], Iterable[tuple[str, str]]]


class _EmbeddedPackage(_abc.MetaPathFinder, _abc.Loader):
    """Serves a package embedded in the binary (`#[py_op(package = ...)]`) from memory."""

    def __init__(self, name: str, root: str, files: _Files) -> None:
        self.name, self.root, self.files = name, root, dict(files)

    def _locate(self, fullname: str) -> Optional[tuple[str, bool]]:
        if fullname == self.name:
            return "__init__.py", True
        if not fullname.startswith(self.name + "."):
            return None
        rel = fullname[len(self.name) + 1 :].replace(".", "/")
        if rel + "/__init__.py" in self.files:
            return rel + "/__init__.py", True
        if rel + ".py" in self.files:
            return rel + ".py", False
        return None

    def find_spec(
        self,
        fullname: str,
        path: Optional[Sequence[str]] = None,
        target: Optional[_types.ModuleType] = None,
    ) -> Optional[_machinery.ModuleSpec]:
        found = self._locate(fullname)
        if found is None:
            return None
        rel, is_package = found
        spec = _util.spec_from_loader(
            fullname, self, origin=self.root + "/" + rel, is_package=is_package
        )
        assert spec is not None  # a loader is given: spec_from_loader makes one
        spec.has_location = True
        return spec

    def create_module(self, spec: _machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: _types.ModuleType) -> None:
        # (A module this finder found.)
        rel, _ = cast(tuple[str, bool], self._locate(module.__name__))
        filename = self.root + "/" + rel
        module.__file__ = filename
        exec(compile(self.files.get(rel, ""), filename, "exec"), module.__dict__)

    def get_source(self, fullname: str) -> Optional[str]:
        found = self._locate(fullname)
        return None if found is None else self.files.get(found[0], "")


_packages: dict[str, _EmbeddedPackage] = {}


def _install_package(name: str, root: str, files: _Files, replace: bool) -> None:
    finder = _packages.get(name)
    if finder is None:
        finder = _packages[name] = _EmbeddedPackage(name, root, files)
        _sys.meta_path.insert(0, finder)
    elif replace and finder.files != dict(files):
        finder.files = dict(files)
        for key in [k for k in _sys.modules if k == name or k.startswith(name + ".")]:
            del _sys.modules[key]
