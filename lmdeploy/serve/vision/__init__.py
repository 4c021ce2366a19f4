"""Image input for vision-language models: loading user images (`images`) and turning them into the engine's
image spans through the checkpoint's own image processor (`processor`)."""
