"""``disttensor.__all__`` is the package's public surface: every name in it exists, none twice,
``from disttensor import *`` gives exactly it, and every public function or class the package
binds is in it (a new export must be listed)."""
import types

import disttensor as dt


def test_all_names_exist_once():
    assert len(set(dt.__all__)) == len(dt.__all__), \
        sorted({n for n in dt.__all__ if dt.__all__.count(n) > 1})
    missing = [n for n in dt.__all__ if not hasattr(dt, n)]
    assert not missing, f"disttensor.__all__ names what the package lacks: {missing}"


def test_star_import_is_all():
    ns: dict = {}
    exec("from disttensor import *", ns)
    assert set(ns) - {"__builtins__"} == set(dt.__all__)


def test_every_public_binding_is_listed():
    bound = {n for n, v in vars(dt).items() if not n.startswith("_")
             and not isinstance(v, types.ModuleType) and n != "annotations"}
    unlisted = sorted(bound - set(dt.__all__))
    assert not unlisted, f"public names of disttensor missing from __all__: {unlisted}"
    assert dt.ops.__all__[0] in dt.__all__ and "OPS" in dt.__all__  # the registry's functions
