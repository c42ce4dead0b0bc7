"""What to build, decided before anything is built: the model directory, the device and the dtype
the settings name (with the CPU's dtype rule and the checkpoint's own dtype). Only decisions live
here; the runtime's builder (engine/runtime/builder.py) assembles the engine from them."""
