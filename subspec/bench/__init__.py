"""``subspec bench``: side-by-side measurement of decoding methods at one memory budget (see :func:`runner.run_bench`)."""
