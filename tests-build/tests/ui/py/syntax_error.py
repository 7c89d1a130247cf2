import math


def bad(x):
    return math.sqrt(x +)
