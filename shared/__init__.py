"""Framework-independent pieces shared by torch_impl and jax_impl (NumPy only).

- config:     the frozen, self-validating run configuration
- problem:    the fixture (weights, inputs) every implementation trains
- results:    the records every implementation returns, and the parity check
- tolerances: how close is close enough, per dtype, with the reason
- theory:     analytic communication / memory / bubble formulas
- dims:       the dimension glossary used in shape comments
- provenance: what produced a result file (versions, devices, commit, command), stdlib only
- schema:     the checker of docs/results-schema.json's subset of JSON Schema
- diff:       what changed between two result files, by severity (compare.py diff)
"""
