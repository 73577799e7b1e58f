"""What the hardware is: the GPU and link catalogue (`catalogue.py`), NCCL's tuning constants
for it (`nccl_constants.py`), and measurements of it as nccl-tests prints them
(`nccl_tests.py`)."""
