"""Many runs: sweeps (locally or on a Dask cluster), the parallelism search, comparisons of
configs, and the calibration of a communication model against nccl-tests measurements."""
