"""Math and contracts shared by the device and the server."""
