"""The commands users run beside generate: the benchmark (bench*), the speed profile (speed_profile,
mar_profile, loop_baselines), drafter training, DD distillation and the GPU check; and what they measure with (the
demo's classifier judge, the enumerable toy model)."""
