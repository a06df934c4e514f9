"""EdgeKV's test and reliability harnesses, kept beside the package (not in the wheel): the
fault matrix (`faults`, `faults_kit`, `faults_local`, `faults_load`, `faults_redis`), the fuzz
supervisor (`fuzz`) and real Redis servers for the tests (`redis_servers`).

In a source checkout `edgekv bench faults` and `edgekv bench fuzz` run them
(`edgekv.bench.checkout` finds this folder next to `src/`); the tests import them through
pytest's `pythonpath`."""
