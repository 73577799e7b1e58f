"""NCCL's collectives as NCCL 2.23 chooses and runs them: `model.py` is the communication
model; `options.py` its config fields and calibrated numbers, `tuner.py` its algorithm and
protocol choice, `system.py` what it sees of the machine, `groups.py` what it works out once
per group of GPUs, `layouts.py` and `families.py` the candidate ring layouts, `streams.py`
the transfers a call makes."""
