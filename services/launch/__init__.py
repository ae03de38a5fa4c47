"""Ways to start a whole epd cluster: local processes (`epd up`) or Ray actors (`epd up --ray`)."""
