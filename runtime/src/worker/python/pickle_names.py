# The only classes and functions a worker's reply pickle may name: both halves of the trust
# boundary read these two lists, nothing else. A worker (and a Ray actor) runs this text before
# `host.py`'s, whose pickler names these and turns anything else into a stand-in; the program
# runs it before `bridge/shared/python/reply.py`'s, whose restricted unpickler accepts these and
# refuses anything else (`worker::PICKLE_NAMES_PY`, `worker::host_py!`).
#
# No NumPy reduce is ever named: an array travels as its dtype's string, its shape and its bytes
# (the constructors below, which the program defines and the worker only names), so the program
# never rebuilds a dtype from a pickled state (which can claim an object dtype's bytes are plain
# numbers) and nothing a body returns can make the program run code.

# The plain types, by their names in `builtins`.
_PICKLED_BUILTINS = (
    "complex",
    "set",
    "frozenset",
    "bytearray",
    "slice",
    "range",
    "tuple",
    "list",
    "dict",
    "int",
    "float",
    "str",
    "bytes",
    "bool",
)

# pyop's own constructors, by their names in the module `_pyop_worker`: a stand-in of an object
# the program could not read as it is, an array of numbers, a NumPy scalar, and the values the
# output check refuses (object arrays, structured arrays, masked arrays).
_PICKLED_CONSTRUCTORS = ("standin", "array", "scalar", "object_array", "structured", "masked")
