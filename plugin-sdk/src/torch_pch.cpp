// Anchor translation unit of the shared LibTorch precompiled header (see torch_pch.h).
