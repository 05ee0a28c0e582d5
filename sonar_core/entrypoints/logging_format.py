"""How Sonar's log lines look, for the command line and the Python API alike."""

LOG_LEVEL_ENV = "SONAR_LOGGING_LEVEL"
LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"
LOG_DATE_FORMAT = "%H:%M:%S"
