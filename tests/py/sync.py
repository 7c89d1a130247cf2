"""Bodies for tests/in_process/executor_tests.rs: events between threads, views kept past a call."""

import queue
import threading

import numpy as np

q = queue.Queue()
event = threading.Event()
saved = []


def put_and_wait(x):
    q.put(float(x[0]))
    q.join()  # until the other thread has taken it
    return x


def take(x):
    v = q.get(timeout=30)
    q.task_done()
    return x + v


def wait_for_event(x):
    if not event.wait(timeout=60):
        raise TimeoutError("nobody set the event")
    return x


def set_event(x):
    event.set()
    return x


def keep(x):
    saved.append(x)


def kept(x):
    v = saved[-1]
    return np.append(np.array(v, dtype=np.float32), np.float32(v.flags.writeable))
