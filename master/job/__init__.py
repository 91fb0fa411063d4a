"""The job core: the control loop (`JobMaster`, master.job.master) and the policies it applies
(launch, exits, health, completion, scaling and autoscaling, PS change, rollback, fault
injection), its events and its checkpoint registry."""
