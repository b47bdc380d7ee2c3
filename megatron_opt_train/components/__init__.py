"""The main job's components, one concern each: data (the built-in corpus and megatron-core's datasets),
evaluation, metrics (the log line, --log-json, the last line), tensorboard, timers, resume (the
checkpoint rules), watchdog, model (the local GPT) and megatron_core_on_cpu (megatron-core's CPU patches)."""
