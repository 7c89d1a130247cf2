"""The embedded-package importer (`body/python/importer.py`): a package served from memory,
found by its module names, refreshed on hot reload."""

import importlib
import sys
import types

FILES = {
    "__init__.py": "X = 1\n",
    "sub/__init__.py": "",
    "sub/mod.py": "from .. import X\nY = X + 1\n",
}


def test_a_package_imports_from_memory_with_its_files_paths(importer: types.ModuleType) -> None:
    importer._install_package("pyopt_pkg", "/virtual/pkg", FILES, False)
    mod = importlib.import_module("pyopt_pkg.sub.mod")
    assert mod.Y == 2
    assert mod.__file__ == "/virtual/pkg/sub/mod.py"
    assert sys.modules["pyopt_pkg"].__file__ == "/virtual/pkg/__init__.py"
    assert sys.modules["pyopt_pkg.sub"].__spec__.submodule_search_locations == []


def test_module_names_map_to_files(importer: types.ModuleType) -> None:
    finder = importer._EmbeddedPackage("pyopt_pkg", "/r", FILES)
    assert finder._locate("pyopt_pkg") == ("__init__.py", True)
    assert finder._locate("pyopt_pkg.sub") == ("sub/__init__.py", True)
    assert finder._locate("pyopt_pkg.sub.mod") == ("sub/mod.py", False)
    assert finder._locate("pyopt_pkg.missing") is None
    assert finder._locate("pyopt_pkgs") is None
    assert finder._locate("json") is None
    spec = finder.find_spec("pyopt_pkg.sub.mod")
    assert (spec.name, spec.origin, spec.has_location) == (
        "pyopt_pkg.sub.mod",
        "/r/sub/mod.py",
        True,
    )
    assert finder.find_spec("json") is None
    assert finder.get_source("pyopt_pkg.sub.mod") == FILES["sub/mod.py"]
    assert finder.get_source("pyopt_pkg.other") is None


def test_a_package_without_init_py_is_an_empty_package(importer: types.ModuleType) -> None:
    importer._install_package("pyopt_bare", "/b", [("a.py", "A = 'a'\n")], False)
    assert importlib.import_module("pyopt_bare.a").A == "a"
    assert not hasattr(sys.modules["pyopt_bare"], "X")


def test_a_second_install_refreshes_only_when_asked_and_changed(
    importer: types.ModuleType,
) -> None:
    importer._install_package("pyopt_pkg", "/p", FILES, False)
    first = importlib.import_module("pyopt_pkg.sub.mod")
    changed = dict(FILES, **{"__init__.py": "X = 10\n"})
    importer._install_package("pyopt_pkg", "/p", changed, False)  # not asked
    assert importlib.import_module("pyopt_pkg.sub.mod") is first
    importer._install_package("pyopt_pkg", "/p", list(FILES.items()), True)  # not changed
    assert importlib.import_module("pyopt_pkg.sub.mod") is first
    importer._install_package("pyopt_pkg", "/p", changed, True)
    assert "pyopt_pkg" not in sys.modules and "pyopt_pkg.sub.mod" not in sys.modules
    assert importlib.import_module("pyopt_pkg.sub.mod").Y == 11
    finders = [f for f in sys.meta_path if getattr(f, "name", None) == "pyopt_pkg"]
    assert finders == [importer._packages["pyopt_pkg"]]
