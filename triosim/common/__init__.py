"""The ground floor every other part imports: errors, units, the config schema's fields,
name registries, interval arithmetic, YAML text and safe output files. Imports nothing of
the project above it."""
