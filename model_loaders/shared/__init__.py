"""What every model family shares: checkpoint reading and family detection, the protocols the samplers
speak, the LLaMA-family decoder (Chameleon, Janus), compiled steps, weight streaming, prompt tokenising, and where
the bundled demo files are."""
