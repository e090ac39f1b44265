from classify_common.early_stop import stop_on_signals_until_serving, stop_with_launcher

stop_on_signals_until_serving()
stop_with_launcher()

from orchestrator.server import main  # noqa: E402 - after the handlers above

# Guarded all the same: a process spawned from a script run by path (not `-m`, whose
# `__main__` multiprocessing leaves alone) imports the main module again.
if __name__ == "__main__":
    main()
