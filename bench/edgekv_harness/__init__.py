"""EdgeKV's test and reliability harnesses, part of the lab's distribution (bench/), not the
wheel: the fault matrix (`faults`, `faults_kit`, `faults_local`, `faults_load`,
`faults_redis`), the fuzz supervisor (`fuzz`) and real Redis servers for the tests
(`redis_servers`).

`edgekv bench faults` and `edgekv bench fuzz` run them (`edgekv_bench.cli`); the tests import
them as installed (`pip install -e bench`)."""
