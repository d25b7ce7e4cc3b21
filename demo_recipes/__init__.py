"""The recipes that rebuild the bundled demo models in demo/ from procedural images (python -m
fastar.demo_recipes.train_vq, train_ar, ...; demo/README.md lists which writes what), and check_demo, which
judges them."""
