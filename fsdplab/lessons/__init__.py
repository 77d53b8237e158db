"""Code that exists for one lesson only, in a module named after that lesson. Shared code lives in the
package proper; these modules run experiments and draw figures that only their lesson needs."""

# Each lesson's module, by the number its notebook's name starts with (notebooks/03_cpu_offload.ipynb is lesson
# 03). A notebook may import other lessons' modules too; this is the one named after its own lesson.
MODULES = {"00": "start_here", "01": "sharding_math", "02": "prefetch", "03": "cpu_offload", "04": "mixed_precision",
           "05": "checkpoints", "06": "qwen7b_lora", "07": "scaling_out", "08": "activation_checkpointing",
           "09": "training_loop", "10": "debugging", "11": "first_fsdp2_script",
           "12": "lora_qlora", "13": "compile_fsdp2", "14": "build_ddp", "15": "build_fsdp"}

# A lesson's code exercise in a module of its own, where the lesson's module would grow past about 500 lines.
CODE_EXERCISES = {"03": "offload_setup", "06": "lora_fsdp", "07": "hsdp", "08": "checkpoint_blocks",
                  "10": "planted_hang"}
