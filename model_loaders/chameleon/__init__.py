"""The Chameleon family (Lumina-mGPT, Anole): the model adapter over the shared LLaMA-family decoder, the
folder reader with its tokenizer and layout, and the VQGAN image decoder."""
