"""The step: the one clock (``driver``), the decision taken on the device (``decision``), the global
gradient statistics (``global_stats``), the gradient multiplier, the per-step checks of the param groups'
hyperparameters (``param_group_checks``) and the phases' timers (``phase_timers``)."""
