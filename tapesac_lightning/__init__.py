"""TapeSAC integrations for Lightning and Accelerate."""
