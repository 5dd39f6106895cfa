"""The pipeline's stages as recipes: data, teacher (and its DDP side), generation, distillation,
evaluation (with code adherence), and the teacher's logit cache."""
