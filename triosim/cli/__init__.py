"""The command line (`triosim ...`): `main.py` builds the parser and runs a command; `run.py`
holds the commands of one run or trace (simulate, info, import, search, trace), `studies.py`
those over many runs and saved results (sweep, compare, plot), `collectives.py` the
collective commands (collectives, calibrate), `chakra.py` export-chakra; `common.py` what
they share (--set, output folders, argument types)."""
