"""Running the modes: the profile's phases on the ranks (a local pool or torchrun), every mode
trained side by side and interleaved step by step, the corpus they train on, the Hugging Face
mode, Hugging Face decoders trained by their own plan beside transformers' TP, and one step of
classic TP without sequence parallelism for its memory."""
