"""Kernel templates (CUTLASS/CuTe .cu.j2, C++ .cpp) shipped as package data; compiler/ renders and builds them."""
