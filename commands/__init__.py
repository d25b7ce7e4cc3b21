"""The commands users run beside the runtime: generate and decode, the benchmark (``bench/``), the speed
profile (``profile/``), drafter training, DD distillation and the GPU check."""
