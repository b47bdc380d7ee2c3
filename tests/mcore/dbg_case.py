import time
def noop():
    return time.time()
def imports():
    t = time.time()
    import cases_model_parallel  # noqa
    import mcore_cpu
    mcore_cpu.init_parallel_state()
    return time.time() - t
