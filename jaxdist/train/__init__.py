"""Train state, jitted step, optimizer, metrics and the Trainer loop."""
