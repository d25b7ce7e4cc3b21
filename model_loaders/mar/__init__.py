"""MAR: the masked autoregressive transformer, its diffusion head, the KL autoencoder and the checkpoint
reader."""
