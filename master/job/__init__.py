"""The job core: the control loop (`JobMaster`) and the policies it consults (relaunch, completion,
scaling, PS change), its events and its checkpoint registry."""
