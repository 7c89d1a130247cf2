from .. import helpers

ONE = 1


def deep_fn(x):
    return helpers.double(helpers.double(x))
