"""bfcl: BFCL v4 multi-turn (base, miss_func, miss_param, long_context) on bfcl-eval's own
backends and checker. Needs the extra `pip install --no-deps -r requirements-bfcl.txt`."""
