"""The command line (`triosim ...`): `main.py` parses and dispatches, `collectives.py` holds
the collective commands (`collectives`, `calibrate`), `chakra.py` `export-chakra`."""
