-- Argo CD health check for gantry.dev/ModelPool (resource.customizations.health.gantry.dev_ModelPool).
-- Reads the conditions the operator writes (crd/src/conditions.rs, docs/operator.md):
--   status not yet for this generation       -> Progressing
--   Degraded=True                            -> Degraded (PluginUpdateHalted, ProgressDeadlineExceeded)
--   Ready=False, reason InvalidSpec/ApplyFailed -> Degraded
--   Ready=False, reason NoMembers             -> Suspended (no Model names the pool; no pod runs)
--   Ready=True, some member refused           -> Degraded (status.refused says which and why)
--   Ready=True, reason ScaledToZero           -> Suspended (the gateway starts a pod on demand)
--   Ready=True                                -> Healthy
--   otherwise                                 -> Progressing (pods starting)
local hs = {}
if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to report status"
  return hs
end

local generation = obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and observed ~= nil and observed < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local ready = nil
local degraded = nil
for _, c in ipairs(obj.status.conditions) do
  if c.type == "Ready" then ready = c end
  if c.type == "Degraded" then degraded = c end
end
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = (degraded.reason or "") .. ": " .. (degraded.message or "")
  return hs
end
if ready == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the Ready condition"
  return hs
end

local said = (ready.reason or "") .. ": " .. (ready.message or "")
if ready.status == "False" and (ready.reason == "InvalidSpec" or ready.reason == "ApplyFailed") then
  hs.status = "Degraded"
  hs.message = said
  return hs
end
if ready.status == "False" and ready.reason == "NoMembers" then
  hs.status = "Suspended"
  hs.message = said
  return hs
end
if ready.status == "True" then
  local refused = obj.status.refused
  if refused ~= nil and #refused > 0 then
    local first = refused[1]
    hs.status = "Degraded"
    hs.message = tostring(#refused) .. " member(s) refused; " .. (first.name or "") .. ": " ..
      (first.reason or "") .. ": " .. (first.message or "")
    return hs
  end
  if ready.reason == "ScaledToZero" then
    hs.status = "Suspended"
  else
    hs.status = "Healthy"
  end
  hs.message = ready.message or ""
  return hs
end
hs.status = "Progressing"
hs.message = said
return hs
