"""On-device SDK: perturbs values locally before anything leaves the device."""
