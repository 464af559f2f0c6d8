-- Argo CD health check for gantry.dev/Model (resource.customizations.health.gantry.dev_Model).
-- Reads the conditions the operator writes (crd/src/conditions.rs, docs/operator.md):
--   Degraded=True                         -> Degraded (InvalidSpec, EngineUnresolved, DownloadFailed,
--                                            LoadFailed, ApplyFailed, ProgressDeadlineExceeded)
--   EngineResolved=False                  -> Degraded (NoMatchingEngine, RejectedByNode)
--   status not yet for this generation    -> Progressing
--   Ready=True, reason ScaledToZero       -> Suspended (no pod runs; the gateway starts one on demand)
--   Ready=True                            -> Healthy
--   otherwise                             -> Progressing (rolling out, downloading, loading)
local hs = {}
local function find(conditions, t)
  for _, c in ipairs(conditions) do
    if c.type == t then return c end
  end
  return nil
end

if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to report status"
  return hs
end

local conditions = obj.status.conditions
local generation = obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and observed ~= nil and observed < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local degraded = find(conditions, "Degraded")
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = (degraded.reason or "") .. ": " .. (degraded.message or "")
  return hs
end

local engine = find(conditions, "EngineResolved")
if engine ~= nil and engine.status == "False" then
  hs.status = "Degraded"
  hs.message = (engine.reason or "") .. ": " .. (engine.message or "")
  return hs
end

local ready = find(conditions, "Ready")
if ready ~= nil and ready.status == "True" then
  if ready.reason == "ScaledToZero" then
    hs.status = "Suspended"
  else
    hs.status = "Healthy"
  end
  hs.message = ready.message or ""
  return hs
end

hs.status = "Progressing"
if ready ~= nil then
  hs.message = (ready.reason or "") .. ": " .. (ready.message or "")
else
  hs.message = "Waiting for the Ready condition"
end
return hs
